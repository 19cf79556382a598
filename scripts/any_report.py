"""The lines of dflash and tracing that say `Any`, and how many of them give no reason.

    python scripts/any_report.py            # per-module counts, then each line without one
    python scripts/any_report.py --counts   # the counts only

A line counts when `Any` is a name in its code (comments, strings and imports aside).
It has a reason when it carries a comment of its own; when the comment block directly
above its statement explains it (the lines of a group of aliases below one comment share
it); or, for a function's signature, when the function's body says why in a comment or
docstring that starts `Any:`. The report also counts `# type: ignore` and how many of them
lack an error code (`[code]`) or a reason (more text after the ignore, or a
`(mypy ignore below)` comment line above). Exit status 0 always: the counts are a
report, not a gate.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash", "tracing")
IGNORE = re.compile(r"#\s*type:\s*ignore(\[[^\]]*\])?(.*)")


@dataclass(frozen=True)
class Line:
    """One line that says `Any`, or one `# type: ignore`."""

    path: str
    number: int
    text: str
    reason: bool


def any_lines(path: Path) -> list[Line]:
    """Each line of `path` with `Any` in its code, and whether a reason goes with it."""
    source = path.read_text()
    lines = source.splitlines()
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    commented: set[int] = set()  # lines with a comment of their own
    uses: set[int] = set()
    statement_start: dict[int, int] = {}  # each line's statement's first line
    start: int | None = None
    in_import = False
    for tok in tokens:
        row = tok.start[0]
        if start is None and tok.type not in (
            tokenize.NL,
            tokenize.COMMENT,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.NEWLINE,
        ):
            start = row
            in_import = tok.type == tokenize.NAME and tok.string in ("import", "from")
        if tok.type == tokenize.COMMENT:
            commented.add(row)
        elif tok.type == tokenize.NAME and tok.string == "Any" and not in_import:
            uses.add(row)
        if start is not None:
            for r in range(start, tok.end[0] + 1):
                statement_start.setdefault(r, start)
        if tok.type == tokenize.NEWLINE:
            start = None
    found = []
    for number in sorted(uses):
        reason = number in commented or _above(lines, statement_start.get(number, number), uses)
        reason = reason or _in_body(lines, number)
        found.append(Line(str(path.relative_to(ROOT)), number, lines[number - 1].strip(), reason))
    return found


def _above(lines: list[str], first: int, uses: set[int]) -> bool:
    """Whether a comment block sits directly above line `first`, past the other lines
    of its group (consecutive statements that also say Any)."""
    row = first - 1
    while row >= 1:
        text = lines[row - 1].strip()
        if text.startswith("#"):
            return True
        if row in uses and text:
            row -= 1
            continue
        # a continuation line of an earlier statement of the group
        if text and not text.startswith(("def ", "class ", "@")) and row + 1 in uses:
            row -= 1
            continue
        return False
    return False


def _in_body(lines: list[str], number: int) -> bool:
    """Whether line `number` is part of a `def` signature whose body says `Any:`."""
    row = number
    while row >= 1 and not lines[row - 1].lstrip().startswith(("def ", "async def ")):
        if lines[row - 1].rstrip().endswith(":") and row != number:
            return False  # the line is in a body, not a signature
        row -= 1
        if number - row > 12:
            return False
    if row < 1:
        return False
    indent = len(lines[row - 1]) - len(lines[row - 1].lstrip())
    body = number
    while body < len(lines) and not lines[body - 1].rstrip().endswith(":"):
        body += 1  # the signature's last line
    for text in lines[body:]:
        if text.strip() and len(text) - len(text.lstrip()) <= indent:
            return False  # past the function
        stripped = text.strip().lstrip("#").strip().lstrip('"').strip()
        if stripped.startswith("Any:") or text.strip().startswith("# Any"):
            return True
    return False


def ignores(path: Path) -> list[Line]:
    """Each `# type: ignore` of `path`, and whether it names an error code and a reason."""
    lines = path.read_text().splitlines()
    found = []
    for number, text in enumerate(lines, 1):
        match = IGNORE.search(text)
        if not match:
            continue
        above = lines[number - 2] if number > 1 else ""
        why = bool(match.group(2).strip(" #")) or "mypy ignore below" in above
        found.append(
            Line(str(path.relative_to(ROOT)), number, text.strip(), bool(match.group(1)) and why)
        )
    return found


def package(rel: str) -> str:
    """The package a module is counted under: dflash/observe, tracing, dflash (top)."""
    parts = rel.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", action="store_true", help="counts only, no lines")
    args = parser.parse_args(argv)
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    anys = [line for f in files for line in any_lines(f)]
    skips = [line for f in files for line in ignores(f)]
    total: Counter[str] = Counter(package(a.path) for a in anys)
    bare: Counter[str] = Counter(package(a.path) for a in anys if not a.reason)
    print(f"{'package':<20} {'Any':>5} {'no reason':>10}")
    for name in sorted(total):
        print(f"{name:<20} {total[name]:>5} {bare[name]:>10}")
    print(f"{'all':<20} {sum(total.values()):>5} {sum(bare.values()):>10}")
    unexplained = [s for s in skips if not s.reason]
    print(f"\n# type: ignore: {len(skips)}, {len(unexplained)} without a code and a reason")
    if not args.counts:
        for a in (a for a in anys if not a.reason):
            print(f"{a.path}:{a.number}: {a.text}")
        for s in unexplained:
            print(f"{s.path}:{s.number}: {s.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
