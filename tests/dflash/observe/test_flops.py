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
    peak_memory_reader,
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


def test_peak_memory_reader_is_none_on_cpu() -> None:
    assert peak_memory_reader("cpu") is None
