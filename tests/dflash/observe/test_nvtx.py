"""The NVTX hook: the no-op path without CUDA, the ranges around each phase."""

from __future__ import annotations

import logging

import pytest
import torch

import tracing
from dflash.observe.instruments import NvtxRanges, nvtx_ranges


def test_nvtx_hook_is_a_one_line_no_op_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the hook is real here")
    with caplog.at_level(logging.WARNING, logger="tracing"):
        assert nvtx_ranges() is None
    (record,) = caplog.records
    assert "NVTX ranges off" in record.getMessage() and "\n" not in record.getMessage()


def test_nvtx_ranges_push_and_pop_around_each_phase() -> None:
    calls: list[str] = []
    hook = NvtxRanges(lambda name: calls.append(f"push {name}"), lambda: calls.append("pop"))
    tracing.setup(tracing.TracingConfig(level="off"), phase_hooks=[hook])
    try:
        with tracing.phase("outer"):
            with tracing.phase("inner"):
                pass
        tracing.start_span("batch").end()  # cross-thread spans get no range
    finally:
        tracing.shutdown(timeout_s=1.0)
    assert calls == ["push outer", "push inner", "pop", "pop"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NVTX needs CUDA")
def test_nvtx_ranges_on_cuda() -> None:
    hook = nvtx_ranges()
    assert hook is not None
    tracing.setup(tracing.TracingConfig(level="off"), phase_hooks=[hook])
    try:
        with tracing.phase("drafter.step"):
            torch.ones(4, device="cuda").sum()
    finally:
        tracing.shutdown(timeout_s=1.0)
