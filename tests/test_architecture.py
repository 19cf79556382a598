"""The layout's rules hold: no import circle, and every import inside a function says why.

The dependency order itself (which package may import which) is import-linter's
contracts in pyproject.toml, checked by `lint-imports` in .ci/run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location(
        "import_report", ROOT / "scripts/import_report.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_no_module_imports_itself_through_others(report) -> None:
    assert report.import_circles() == []


def test_circles_are_found(report) -> None:
    """The finder itself: a made-up graph with one circle and one chain."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert report._strongly_connected(edges) == [["a", "b", "c"]]


def test_every_function_level_project_import_is_justified(report) -> None:
    late = report.late_imports()
    assert [i for i in late if i.reason is None] == []
    # They defer torch from the command line only: the library imports at the top.
    assert {i.path.split("/")[1] for i in late} <= {"cli"}
