"""The `dflash-train` command group and `main`.

The group only registers the commands; each command module builds the config from its
options and calls one entry point of the library.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from dflash.cli import data, results, train
from dflash.cli.options import echo_err, unknown_variables
from dflash.log import line_writer
from dflash.signals import Interrupted, StopSignals, TrainingInterrupted


class _DefaultGroup(click.Group):
    """`dflash-train` alone (or with only train flags) means `dflash-train train`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0].startswith("-") and args[0] not in ("--help", "-h", "--version")):
            args = ["train", *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> object:
        signals = StopSignals(_main_phase).install()
        try:
            with line_writer(echo_err):  # the `dflash` logger's lines: standard error
                return super().invoke(ctx)
        except Interrupted as exc:  # one line, and the exit code (130, 143, 129) it carries
            click.echo(f"Error: {exc.describe()}", err=True)
            raise
        except TrainingInterrupted as exc:  # the checkpoint and summary are written: the line
            click.echo(f"Error: {_training_stop(exc)}", err=True)
            raise
        finally:
            signals.restore()


def _training_stop(exc: TrainingInterrupted) -> str:
    """The last line of a training run that a signal stopped."""
    steps = (exc.summary or {}).get("steps")
    at = f" at step {steps}" if isinstance(steps, int) else ""
    return f"stopped by {signal.Signals(exc.signum).name} during training{at}"


def _main_phase() -> str | None:
    """The phase the main thread is in (target.load, data.regenerate, eval, ...). Looked
    up, not imported: before a run's telemetry is set up no phase is watched, and --help
    stays quick."""
    instruments = sys.modules.get("dflash.observe.instruments")
    return None if instruments is None else instruments.MAIN_THREAD_PHASE.current()


@click.group(cls=_DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash-train")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Train DFlash block-diffusion drafters; every pipeline phase is traced.

    Without a command, runs `train` on the embedded default (a built-in tiny target
    on the Python standard library's source; CPU, no downloads).
    """
    known = [
        name
        # (mypy ignore below) the root command is a click.Group
        for command in ctx.command.commands.values()  # type: ignore[attr-defined]
        for param in command.params
        for name in ([param.envvar] if isinstance(param.envvar, str) else param.envvar or [])
    ]
    for line in unknown_variables(os.environ, known):
        echo_err(line)


COMMANDS = (
    train.train,
    results.eval_command,
    results.export_command,
    train.prepare_target,
    results.report_command,
    data.regenerate_command,
    data.cache_hidden_command,
    data.inspect_data_command,
)
for command in COMMANDS:
    cli.add_command(command)


def main() -> None:
    cli(prog_name="dflash-train")
