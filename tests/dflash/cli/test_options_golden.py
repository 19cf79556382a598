"""Every command's options, names and defaults, against a reviewed snapshot.

An option added, renamed, or given a new default or variable changes
tests/dflash/cli/options.golden.json, so the change is a diff a reviewer reads (as
speculators keeps one). After a deliberate change, rewrite the snapshot:

    UPDATE_GOLDEN=1 pytest tests/dflash/cli/test_options_golden.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import click

from dflash.cli.app import cli

GOLDEN = Path(__file__).with_name("options.golden.json")


SHOWN = re.compile(r"\((default: .*|required)\)$", re.DOTALL)


def _default(param: click.Parameter) -> Any:
    """The declared default help shows (click's own is None: "not given", so that a
    --config file's value stands), else click's."""
    shown = SHOWN.search(getattr(param, "help", None) or "")
    if shown:
        return " ".join(shown.group(1).split()).removeprefix("default: ")
    default = param.default
    if type(default).__name__ == "Sentinel":  # click's UNSET: no default
        return None
    if callable(default):
        return "<computed>"
    if isinstance(default, tuple | list):
        return list(default)
    if default is None or isinstance(default, bool | int | float | str):
        return default
    return str(default)


def _param(param: click.Parameter) -> dict[str, Any]:
    entry: dict[str, Any] = {"opts": sorted(param.opts + param.secondary_opts)}
    entry["type"] = param.type.name
    if isinstance(param.type, click.Choice):
        entry["choices"] = list(param.type.choices)
    entry["default"] = _default(param)
    if param.multiple:
        entry["multiple"] = True
    if isinstance(param, click.Option):
        if param.is_flag:
            entry["flag"] = True
        if param.envvar:
            entry["envvar"] = param.envvar
    else:
        entry["argument"] = True
    return entry


def options_snapshot() -> dict[str, dict[str, Any]]:
    """{command: {param name: its options, type, default, variable}}."""
    return {
        name: {param.name or "": _param(param) for param in command.params}
        for name, command in sorted(cli.commands.items())
    }


def _dumps(snapshot: dict[str, dict[str, Any]]) -> str:
    """One line per option: a change is a one-line diff."""
    lines = ["{"]
    for i, (command, params) in enumerate(snapshot.items()):
        lines.append(f"  {json.dumps(command)}: {{")
        for j, (name, entry) in enumerate(params.items()):
            comma = "," if j < len(params) - 1 else ""
            lines.append(f"    {json.dumps(name)}: {json.dumps(entry, ensure_ascii=False)}{comma}")
        lines.append("  }" + ("," if i < len(snapshot) - 1 else ""))
    return "\n".join([*lines, "}", ""])


def test_options_equal_the_reviewed_snapshot() -> None:
    found = options_snapshot()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(_dumps(found))
    expected = json.loads(GOLDEN.read_text())
    for command in sorted(set(found) | set(expected)):
        assert found.get(command) == expected.get(command), (
            f"`{command}`'s options differ from {GOLDEN.name}; after a deliberate change "
            "run UPDATE_GOLDEN=1 pytest tests/dflash/cli/test_options_golden.py"
        )
