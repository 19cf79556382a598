"""`dflash-train`: the command line (click).

app      the command group and `main`
options  option types, every command's options from the declarations, one-line errors
train    `train` and `prepare-target`
results  `eval`, `report` and `export`
data     `regenerate`, `cache-hidden` and `inspect-data`
startup  the signal handlers of the first milliseconds

This module imports nothing heavy: `main` puts the signal handlers in place before the
command line's own imports, and `cli` is looked up on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.cli.startup import entering, install_startup_handlers

if TYPE_CHECKING:
    import click

__all__ = ["cli", "main"]


def main() -> None:
    """`dflash-train` (and `python -m dflash.cli`): a signal from the first millisecond
    on is one line and exit code 130/143/129."""
    install_startup_handlers()
    from dflash.cli.app import main as run_command  # deferred: after the handlers

    try:
        run_command()
    finally:
        entering("shut-down")  # exit handlers (telemetry flushes) run after this


def __getattr__(name: str) -> click.Group:
    if name == "cli":
        from dflash.cli.app import cli  # deferred: main installs signal handlers first

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
