"""`dflash-train train` and `prepare-target`."""

from __future__ import annotations

from typing import Any

import click

from dflash.cli.options import (
    build_config,
    check_cache_dir,
    debug_option,
    echo_err,
    report_errors,
    schema_option,
    train_options,
)
from dflash.cli.startup import exiting_at_once
from dflash.config.settings import config_from_options
from dflash.errors import first_line
from dflash.pipeline.queues import PipelineError
from dflash.run.outputs import check_run_outputs


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML, TOML or JSON file of option values: flat option names (snake_case or "
    "kebab-case) or sections as in OUTPUT_DIR/config.json, which reproduces that run. "
    "Flags and DFLASH_* variables override it.",
)
@train_options
def train(config_file: str | None, **given: Any) -> None:
    """Train a drafter: final drafter in OUTPUT_DIR/drafter/, figures in summary.json."""
    debug = bool(given.get("debug"))
    cfg = report_errors(debug, lambda: build_config(config_file, given))
    if cfg.run.dry_run:
        with exiting_at_once():
            from dflash.run.estimate import dry_run_lines  # deferred: torch

        click.echo("\n".join(report_errors(cfg.run.debug, lambda: dry_run_lines(cfg))))
        return
    # Every path the run writes: --output-dir, and the files besides its folder's.
    report_errors(cfg.run.debug, lambda: check_run_outputs(cfg, config_file))
    check_cache_dir()
    with exiting_at_once():
        from dflash.run.pipelined import run_training  # deferred: torch, so --help answers at once
    try:
        report_errors(cfg.run.debug, lambda: run_training(cfg, log=echo_err))
    except PipelineError as exc:
        if cfg.run.debug:
            raise
        # A stage failed at run time: one line (the traceback is in the log file), exit 1.
        raise click.ClickException(first_line(exc)) from None


@click.command("prepare-target")
@schema_option(
    "target",
    "Target to prepare: builtin:tiny trains and caches the tiny LM (always with seed 0, so "
    "every run finds the same one) under $DFLASH_CACHE_DIR, else ~/.cache/dflash-train; a "
    "Hugging Face id or directory is loaded once (downloaded where the machine has internet).",
)
@debug_option
def prepare_target(target: str | None, debug: bool) -> None:
    """Prepare (train or download) and cache a target so that `train` starts at once."""
    check_cache_dir()
    with exiting_at_once():
        from dflash.target.load import prepare_target_spec  # deferred: torch

    def go() -> None:
        spec = config_from_options({"target": target}).target.spec
        click.echo(str(prepare_target_spec(spec, log=echo_err)))

    report_errors(debug, go)
