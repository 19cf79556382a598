"""`dflash-train train` and `prepare-target`."""

from __future__ import annotations

import click

from dflash.cli.options import Command, InputError, check_cache_dir, report_errors
from dflash.cli.startup import exiting_at_once
from dflash.config.schema import Value
from dflash.config.settings import options
from dflash.errors import first_line
from dflash.log import say
from dflash.observe.trackers import check_installed
from dflash.pipeline.queues import PipelineError
from dflash.run.outputs import check_run_outputs

TRAIN = Command(
    {},
    (opt.name for opt in options()),
    config_help="YAML, TOML or JSON file of option values: flat option names (snake_case or "
    "kebab-case) or sections as in OUTPUT_DIR/config.json, which reproduces that run (its "
    "invocation flags, such as --overwrite, are left out: give them here). Flags and "
    "DFLASH_* variables override it.",
)


@click.command()
@TRAIN
def train(config_file: str | None, **given: Value) -> None:
    """Train a drafter: final drafter in OUTPUT_DIR/drafter/, figures in summary.json."""
    debug = bool(given.get("debug"))
    cfg = report_errors(debug, lambda: TRAIN.resolve(config_file, given).run)
    if cfg.run.dry_run:
        with exiting_at_once():
            from dflash.run.estimate import dry_run_lines  # deferred: torch

        click.echo("\n".join(report_errors(cfg.run.debug, lambda: dry_run_lines(cfg))))
        return
    # Every path the run writes: --output-dir, and the files besides its folder's.
    report_errors(cfg.run.debug, lambda: check_run_outputs(cfg, config_file))
    check_cache_dir()
    report_errors(cfg.run.debug, lambda: check_installed(cfg.telemetry.report_to))
    with exiting_at_once():
        from dflash.run.pipelined import run_training  # deferred: torch, so --help answers at once
    try:
        report_errors(cfg.run.debug, lambda: run_training(cfg, log=say))
    except PipelineError as exc:
        if cfg.run.debug:
            raise
        # A stage failed at run time: one line (the traceback is in the log file), exit 1.
        raise click.ClickException(first_line(exc)) from None
    lost_trace_file(cfg.telemetry.trace_file, cfg.run.output_dir)


def lost_trace_file(trace_file: str | None, output_dir: str) -> None:
    """A --trace-file that a write failed on (a full disk, /dev/full) ends the command
    with one line and exit 2 once the run is complete: training does not stop for it
    (an exporter never blocks training), but the spans are lost."""
    from tracing.export import trace_file_errors  # deferred: OpenTelemetry, after the run

    failed = trace_file_errors()
    if trace_file is not None and trace_file in failed:
        raise InputError(
            f"--trace-file {trace_file!r}: could not write ({failed[trace_file]}): spans "
            f"are lost; the run itself is complete in {output_dir}"
        )


PREPARE_TARGET = Command(
    {},
    ("target", "debug"),
    help={
        "target": "Target to prepare: builtin:tiny trains and caches the tiny LM (always with "
        "seed 0, so every run finds the same one) under $DFLASH_CACHE_DIR, else "
        "~/.cache/dflash-train; a Hugging Face id or directory is loaded once (downloaded "
        "where the machine has internet).",
    },
)


@click.command("prepare-target")
@PREPARE_TARGET
def prepare_target(config_file: str | None, **given: Value) -> None:
    """Prepare (train or download) and cache a target so that `train` starts at once."""
    debug = bool(given["debug"])
    spec = report_errors(debug, lambda: PREPARE_TARGET.resolve(config_file, given)).run.target.spec
    check_cache_dir()
    with exiting_at_once():
        from dflash.target.load import prepare_target_spec  # deferred: torch

    click.echo(str(report_errors(debug, lambda: prepare_target_spec(spec, log=say))))
