"""FLOPs per token against torch's own FLOP counter; the MFU table and arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dflash.observe.flops import (
    achieved_tflops,
    attention_flops,
    drafter_flops,
    linear_params,
    mfu,
    peak_tflops,
    target_flops_per_token,
)


def counted(fn) -> int:  # type: ignore[no-untyped-def]
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_linear_flops_match_torch_counter() -> None:
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False))
    tokens = torch.randn(10, 32)
    assert 2 * linear_params(model) * 10 == counted(lambda: model(tokens))


def test_attention_flops_match_torch_counter() -> None:
    heads, head_dim, keys = 4, 16, 24
    q = torch.randn(1, heads, 1, head_dim)
    k = v = torch.randn(1, heads, keys, head_dim)
    reference = counted(lambda: F.scaled_dot_product_attention(q, k, v))
    assert attention_flops(1, heads, head_dim, keys) == reference


def test_training_counts_three_forwards_and_the_frozen_head_twice() -> None:
    layer = nn.Linear(16, 16, bias=False)
    head = nn.Linear(16, 50, bias=False).requires_grad_(False)
    x = torch.randn(8, 16, requires_grad=True)
    reference = counted(lambda: head(layer(x)).sum().backward())
    # Attention left out (no layers of it here): only the weight terms are compared.
    figures = drafter_flops(layer.weight.numel(), 0, head.weight.numel(), 0, 1, 1, 0, 1)
    assert figures.per_block_token * 8 == reference


def test_target_flops_per_token_adds_causal_attention() -> None:
    assert target_flops_per_token(100, 2, 4, 8, 9) == 200 + 4 * 2 * 4 * 8 * 5


def test_peak_table_and_mfu() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("Some CPU") is None
    assert achieved_tflops(1e9, 2e4) == pytest.approx(20.0)
    assert mfu(1e9, 2e4, 100.0, num_devices=2) == pytest.approx(0.1)
    assert mfu(1e9, 2e4, None) is None


def test_cpu_matmul_peak_is_measured_once_per_process(tmp_path, monkeypatch) -> None:
    from dflash.observe.flops import cpu_matmul_peak_gflops

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    first = cpu_matmul_peak_gflops(torch.float32, size=96, repeats=1)
    assert first > 0 and cpu_matmul_peak_gflops(torch.float32, size=96, repeats=1) == first


def test_the_cpu_peak_is_the_best_any_process_measured(tmp_path, monkeypatch) -> None:
    """A peak measured on a busy machine reads low: the best one seen on this CPU wins."""
    from dflash.observe import flops

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    for measured, expected in [(50.0, 50.0), (20.0, 50.0), (80.0, 80.0)]:
        monkeypatch.setattr(flops, "_measure_matmul", lambda *_, m=measured: m)
        flops._cpu_matmul_peak.cache_clear()  # as a new process
        assert flops.cpu_matmul_peak_gflops(torch.float32, size=64) == expected
    flops._cpu_matmul_peak.cache_clear()
    assert (tmp_path / flops.PEAKS_FILE).exists()


def test_a_cpu_stage_shows_its_flops_as_a_share_of_the_measured_peaks(monkeypatch) -> None:
    """GFLOP/s, then its share of the CPU's fp32 and bf16 matmul peaks (bf16 only where
    the CPU has it natively)."""
    from types import SimpleNamespace

    from dflash.config import devices
    from dflash.observe import instruments, observer

    peaks = {"fp32": 100.0, "bf16": 400.0}
    by_dtype = {torch.float32: peaks["fp32"], torch.bfloat16: peaks["bf16"]}
    monkeypatch.setattr(instruments, "cpu_matmul_peak_gflops", lambda dtype: by_dtype[dtype])
    rates: dict[str, tuple] = {}
    reporter = SimpleNamespace(add_rate=lambda name, fn, unit: rates.update({name: (fn, unit)}))
    snapshot = SimpleNamespace(target_tokens=0, drafter_tokens=1000)
    cpu = [torch.device("cpu")]
    for flags, shares in [(("avx512_bf16",), {"fp32": 50.0, "bf16": 12.5}), ((), {"fp32": 50.0})]:
        monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None, f=flags: f)
        figures = instruments.flops_figures(0.0, 5e7, cpu, cpu)  # 50 GFLOP in 1000 tokens
        assert figures.drafter_cpu_peaks == {name: peaks[name] for name in shares}
        rates.clear()
        observer._add_flops(reporter, lambda: snapshot, figures, world_size=1)
        assert rates["drafter FLOPs"][0]() == pytest.approx(50.0)
        for name, share in shares.items():
            fn, unit = rates[f"drafter {name} share"]
            assert fn() == pytest.approx(share)
            assert unit == f"% of {peaks[name]:,.0f} GFLOP/s peak"
        assert set(rates) == {"drafter FLOPs", *(f"drafter {n} share" for n in shares)}
