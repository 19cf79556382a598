"""ProfileWindow: the real torch.profiler over the steps of a window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.config.checks import parse_steps
from dflash.observe.profile_window import ProfileWindow


def test_parse_steps() -> None:
    assert parse_steps("200:205") == (200, 205)
    assert parse_steps(" 7 ") == (7, 8)
    for bad in ("", "a:b", "5:5", "9:3", "-1:2", "1:2:3"):
        with pytest.raises(ValueError) as info:
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
    with pytest.raises(ValueError, match="cannot be created"):
        ProfileWindow("1:2", blocker / "profile")
