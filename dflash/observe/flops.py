"""Model FLOPs of the target forward and the drafter training step, per token; the
achieved TFLOP/s and MFU against a device's peak.

Counted as multiply-adds × 2 of the matrix products (norms, activations and softmax are
left out, as in the usual MFU convention). Attention counts the keys each query sees:
causal target rows see (T+1)/2 keys on average; a drafter block token sees its
anchor's context (about T/2 on average, anchors being uniform) plus its own block.
Training costs three times the forward (forward, input and weight gradients) for the
trained weights; the frozen LM head costs its forward and the input gradient only.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import nn

from dflash.files import cache_dir, write_json_atomic


def linear_params(module: nn.Module) -> int:
    """Weights of every nn.Linear under `module` (what the matrix products multiply)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def attention_flops(num_layers: int, num_heads: int, head_dim: int, keys: float) -> float:
    """Forward FLOPs of QKᵀ and AV for one query token over `keys` keys, all layers."""
    return 4.0 * num_layers * num_heads * head_dim * keys


def target_flops_per_token(
    linear_weights: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int
) -> float:
    """Forward FLOPs per token of a causal decoder (`linear_weights` incl. the LM head
    when the logits are computed)."""
    return 2.0 * linear_weights + attention_flops(
        num_layers, num_heads, head_dim, (seq_len + 1) / 2
    )


@dataclass(frozen=True)
class DrafterFlops:
    per_block_token: float
    """Training FLOPs of one block token (anchor or masked position)."""
    per_context_token: float
    """Training FLOPs of the fusion (K·D -> D projection) on one context token."""

    def per_step(self, num_block_tokens: int, num_context_tokens: int) -> float:
        return self.per_block_token * num_block_tokens + self.per_context_token * num_context_tokens


def drafter_flops(
    layer_weights: int,
    fusion_weights: int,
    lm_head_weights: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    seq_len: int,
    block_size: int,
) -> DrafterFlops:
    """Training FLOPs of the drafter: trained layer and fusion weights ×3 of their
    forward, the frozen LM head ×2 (forward and input gradient)."""
    keys = seq_len / 2 + block_size
    block_forward = 2.0 * layer_weights + attention_flops(num_layers, num_heads, head_dim, keys)
    return DrafterFlops(
        per_block_token=3.0 * block_forward + 4.0 * lm_head_weights,
        per_context_token=3.0 * 2.0 * fusion_weights,
    )


# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendor's data sheets.
# Matched against the device name in this order: the first listed substring wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def peak_tflops(device_name: str) -> float | None:
    """Peak bf16 TFLOP/s of a device named like torch.cuda.get_device_name(); None if unknown."""
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def achieved_tflops(flops_per_token: float, tokens_per_s: float) -> float:
    return flops_per_token * tokens_per_s / 1e12


def mfu(
    flops_per_token: float, tokens_per_s: float, peak: float | None, num_devices: int = 1
) -> float | None:
    """Model FLOPs utilization in [0, 1]: achieved over `num_devices` × peak TFLOP/s."""
    if peak is None or peak <= 0 or num_devices < 1:
        return None
    return achieved_tflops(flops_per_token, tokens_per_s) / (peak * num_devices)


def device_peak_tflops(device: torch.device | str) -> float | None:
    """The peak of a torch device (None on CPU, or a GPU not in the table)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name(device))


PEAKS_FILE = "cpu-matmul-peaks.json"  # under cache_dir(): the best rate seen per CPU


def cpu_matmul_peak_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 3) -> float:
    """This CPU's matmul rate in GFLOP/s at torch's thread count: the best of `repeats`
    products of two size×size matrices of `dtype` (2 AVX512-BF16 threads: about 110 fp32,
    360 bf16; some 0.1 s for both), measured once per process, and the best any process
    measured on this CPU before (cache_dir()/PEAKS_FILE): a peak measured while other
    work shares the cores reads low. The interval tables set the achieved FLOP/s beside it."""
    return _cpu_matmul_peak(dtype, size, repeats, torch.get_num_threads())


def _cpu_name() -> str:
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


@cache
def _cpu_matmul_peak(dtype: torch.dtype, size: int, repeats: int, threads: int) -> float:
    measured = _measure_matmul(dtype, size, repeats)
    key = f"{_cpu_name()} | {threads} threads | {dtype} {size} | torch {torch.__version__}"
    path = cache_dir() / PEAKS_FILE
    try:
        seen = json.loads(path.read_text(encoding="utf-8"))
        seen = seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        seen = {}
    best = max(measured, float(seen.get(key, 0.0)))
    if best > float(seen.get(key, 0.0)):
        with contextlib.suppress(OSError):  # a read-only cache keeps this process's figure
            write_json_atomic(path, {**seen, key: best})
    return best


def _measure_matmul(dtype: torch.dtype, size: int, repeats: int) -> float:
    a = torch.full((size, size), 0.5, dtype=dtype)
    b = torch.full((size, size), 0.25, dtype=dtype)
    best_s = float("inf")
    for i in range(repeats + 1):  # the first one warms the kernels up, untimed
        start_s = time.perf_counter()
        torch.mm(a, b)
        if i:
            best_s = min(best_s, time.perf_counter() - start_s)
    return 2.0 * size**3 / best_s / 1e9
