"""The README and docs name only what exists: every repository path they cite, and every
dotted `dflash.…`/`tracing.…` name, which is a module, an attribute of one, or a
telemetry name the code declares (span, attribute and metric names share the prefix)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("dflash/", "tracing/", "bench/", "scripts/", "tools/", "configs/", "docs/", "tests/")
TOP += ("docker/", ".ci/")
TOPS = "|".join(map(re.escape, TOP))
PATH = re.compile(rf"(?<![\w./-])((?:{TOPS})[\w./-]*[\w/])")
DOTTED = re.compile(r"(?<![\w./-])((?:dflash|tracing)(?:\.[A-Za-z_]\w*)+)")
LITERAL = re.compile(r"""["']([\w.]+)["']""")
COMPOSED = re.compile(r"\{\w+\}\.([\w.]+)")


def _declared_names() -> set[str]:
    """String literals of the code: the telemetry names a doc may cite."""
    names: set[str] = set()
    for package in ("dflash", "tracing"):
        for source in (ROOT / package).rglob("*.py"):
            text = source.read_text()
            names.update(LITERAL.findall(text))
            names.update(COMPOSED.findall(text))  # f"{ns}.run.id": cited as dflash.run.id
    return names


def _resolves(dotted: str) -> bool:
    """A module, or attributes reached from the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def _cited(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return [
        (doc.name, match.group(1).rstrip("."))
        for doc in DOCS
        for match in pattern.finditer(doc.read_text())
    ]


@pytest.mark.parametrize("doc", [doc.name for doc in DOCS])
def test_cited_paths_exist(doc: str) -> None:
    missing = [path for name, path in _cited(PATH) if name == doc and "*" not in path]
    missing = [path for path in missing if not (ROOT / path).exists()]
    assert not missing, f"{doc} cites paths that do not exist: {sorted(set(missing))}"


def test_cited_modules_and_names_exist() -> None:
    declared = _declared_names()
    unknown = {
        f"{doc}: {dotted}"
        for doc, dotted in _cited(DOTTED)
        if dotted not in declared
        and dotted.removeprefix("dflash.") not in declared
        and not _resolves(dotted)
    }
    assert not unknown, f"docs cite names nothing declares: {sorted(unknown)}"
