"""ProfileWindow (real torch.profiler) and the NVTX hook (the no-op path without CUDA)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import tracing
from tracing.hooks import NvtxRanges, nvtx_ranges
from tracing.profiler import ProfileWindow, parse_steps

# The library runs without torch (scripts/otel_versions.sh tests it so); this file is
# about its torch parts.
torch = pytest.importorskip("torch")


def test_parse_steps() -> None:
    assert parse_steps("200:205") == (200, 205)
    assert parse_steps(" 7 ") == (7, 8)
    for bad in ("", "a:b", "5:5", "9:3", "-1:2", "1:2:3"):
        with pytest.raises(tracing.TracingConfigError) as info:
            parse_steps(bad)
        assert repr(bad) in str(info.value) and "\n" not in str(info.value)


def test_window_records_exactly_its_steps(tmp_path: Path) -> None:
    window = ProfileWindow("2:4", tmp_path / "profile", rank=1)
    for step in range(6):
        window.before_step(step)
        with torch.autograd.profiler.record_function(f"work-step-{step}"):
            torch.ones(8, 8) @ torch.ones(8, 8)
        assert (window.path_for(step) is not None) == (2 <= step < 4)
    path = window.close()
    assert path == tmp_path / "profile" / "steps-2-3.rank1.pt.trace.json"
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"work-step-2", "work-step-3"} <= names
    assert not names & {"work-step-1", "work-step-4"}


def test_window_cut_short_by_the_run_end_is_written(tmp_path: Path) -> None:
    window = ProfileWindow("1:100", tmp_path)
    window.before_step(1)
    torch.ones(4).sum()
    assert window.close() is not None and window.done


def test_unwritable_profile_dir_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(tracing.TracingConfigError, match="cannot be created"):
        ProfileWindow("1:2", blocker / "profile")


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
