"""The data subcommands of `dflash-train`: `regenerate` and `cache-hidden`."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from dflash.cli.options import (
    OVERWRITE_JSON,
    Command,
    check_cache_dir,
    check_output,
    echo_err,
    locked_output,
    report_errors,
    server_settings,
)
from dflash.cli.startup import exiting_at_once
from dflash.config.commands import DeviceConfig, InspectDataConfig, ServerConfig
from dflash.config.schema import Value
from dflash.log import say
from dflash.offline.config import (
    CacheHiddenConfig,
    RegenerateConfig,
    RegenerateJobConfig,
)

if TYPE_CHECKING:
    from dflash.offline.regenerate import RegenProgress, RegenReport


class _RegenBar:
    """Lines done and tokens/s: a bar on a terminal; elsewhere (a log) a line every few
    seconds with lines, tokens/s and the time left."""

    EVERY_S = 5.0

    def __init__(self) -> None:
        self.bar: Any = None  # Any: click's ProgressBar, a class of its private _termui_impl
        self.done = 0
        self.started = time.monotonic()
        self.last_line = -math.inf
        self.first_done: int | None = None

    def __call__(self, p: RegenProgress) -> None:
        rate = f"{p.tokens_per_s:,.0f} tokens/s"
        if sys.stderr.isatty():
            if self.bar is None:
                self.bar = click.progressbar(
                    length=p.lines_total, label="regenerate", file=sys.stderr, show_pos=True
                )
                self.bar.__enter__()
                self.bar.update(self.done)
            self.bar.label = f"regenerate ({rate})"
            self.bar.update(p.lines_done - self.done)
        else:
            now = time.monotonic()
            if self.first_done is None:
                self.first_done = p.lines_done  # a resumed run's lines were there already
            if now - self.last_line >= self.EVERY_S or p.lines_done == p.lines_total:
                left = self._eta(p.lines_done, p.lines_total, now)
                echo_err(f"regenerate: {p.lines_done}/{p.lines_total} lines, {rate}{left}")
                self.last_line = now
        self.done = p.lines_done

    def _eta(self, done: int, total: int, now: float) -> str:
        new_lines = done - (self.first_done or 0)
        if new_lines <= 0 or done >= total:
            return ""
        left_s = (total - done) * (now - self.started) / new_lines
        return f", about {left_s / 60:.0f} min left" if left_s >= 60 else f", {left_s:.0f} s left"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


TARGET_PRECISION_HELP = (
    "Dtype of the target: `bf16`, `fp32`, or `auto`: bf16 on CUDA, and on a CPU with native "
    "bf16 (AVX512-BF16 or AMX) for a target of hidden size 512 or more, else fp32."
)

REGENERATE = Command(
    {
        "regenerate": RegenerateConfig,
        "regenerate_job": RegenerateJobConfig,
        "server": ServerConfig,
        "device": DeviceConfig,
    },
    """target data output max_new_tokens temperature stop_token_ids prefix_tokens
    windows_per_document batch_size chunk_lines seed heldout_fraction chat_template_kwargs
    server concurrency request_timeout retries server_model device precision otlp_endpoint
    otlp_protocol trace_file service_name debug""".split(),
    help={
        "target": "Target whose own replies replace the data's.",
        "data": "Chat JSONL ({'messages': [...]}: every assistant turn is regenerated given "
        "the conversation so far), or plain text (`embedded`, a file, a folder, JSONL with "
        "'text'): windows whose first --prefix-tokens tokens are kept and whose continuation "
        "is regenerated. Held-out documents (same split as train) are left out.",
        "seed": "Seed of sampling when --temperature is above 0.",
        "heldout_fraction": "Share of documents held out (as in train): not regenerated.",
        "server": "An OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server) serving "
        "the target: its /v1/completions writes the replies, and only --target's tokenizer "
        "loads here (e.g. http://localhost:8000).",
        "device": "Device for the target (cpu, cuda:0, ...); auto picks cuda:0 when present.",
        "precision": TARGET_PRECISION_HELP,
    },
)


@click.command("regenerate")
@REGENERATE
def regenerate_command(config_file: str | None, **given: Value) -> None:
    """Regenerate training data with the target's own replies (the recommended recipe)."""
    debug = bool(given["debug"])
    settings = report_errors(debug, lambda: REGENERATE.resolve(config_file, given))
    cfg, job, server = settings.run, settings.get(RegenerateJobConfig), settings.get(ServerConfig)
    decoding = report_errors(
        debug,
        lambda: dataclasses.replace(
            settings.get(RegenerateConfig),
            seed=cfg.run.seed,
            heldout_fraction=cfg.data.heldout_fraction,
        ),
    )
    source, output = cfg.data.source, job.output
    inputs = [("--config", config_file), ("--data", source)]
    inputs += [("--target", settings.given.get("target"))]
    check_output(output, "--output", inputs=inputs)
    check_cache_dir()
    bar = _RegenBar()

    def go() -> RegenReport:
        served = None if server.server is None else server_settings(server, job.concurrency)
        try:
            return regenerate_data(
                cfg.target.spec,
                settings.get(DeviceConfig).device,
                source,
                output,
                decoding,
                progress=bar,
                log=say,
                chat_template_kwargs=cfg.target.parsed_chat_template_kwargs,
                server=served,
                precision=cfg.pipeline.precision,
            )
        finally:
            bar.close()

    with locked_output(output, "--output", debug):  # before torch: a second writer at once
        with exiting_at_once():
            from dflash.observe.command_trace import command_trace  # deferred: torch
            from dflash.run.offline import regenerate_data  # deferred: torch, so --help is quick

        def traced() -> RegenReport:
            with command_trace("regenerate", cfg.telemetry, say):
                return go()

        report = report_errors(debug, traced)
    for line in report.skipped.lines(0):
        echo_err(line)
    resumed = f", continued after line {report.resumed_from_line}" * bool(report.resumed_from_line)
    rate = report.new_tokens / report.wall_s if report.wall_s > 0 else 0.0
    echo_err(
        f"regenerate: {report.lines} lines in {report.output}{resumed}; {report.new_tokens:,} "
        f"new tokens in {report.wall_s:.1f} s ({rate:,.0f} tokens/s)"
    )
    click.echo(str(report.output))


CACHE_HIDDEN = Command(
    {"cache_hidden": CacheHiddenConfig},
    # After its own, the train options that decide what the target computes for batch i.
    """output num_batches batches_per_shard format samples_only target target_layers
    drafter_layers data packing seq_len batch_size seed heldout_fraction use_soft_labels steps
    target_devices precision chat_template_kwargs chat_rendering debug""".split(),
    help={
        "precision": "Dtype of the target, and of the states the cache holds: `bf16`, `fp32`, "
        "or `auto`: bf16 on CUDA, else fp32 (what `train --hidden-cache` under auto reads; "
        "give the same --precision to both)."
    },
    config_help="The config file of the `train` run that will read the cache (its other keys "
    "are not used here).",
)


@click.command("cache-hidden")
@CACHE_HIDDEN
def cache_hidden_command(config_file: str | None, **given: Value) -> None:
    """Run the target once over the training batches and write their hidden states, for
    `train --hidden-cache DIR` with the same target, layer and data options."""
    debug = bool(given["debug"])
    settings = report_errors(debug, lambda: CACHE_HIDDEN.resolve(config_file, given))
    cfg, job = settings.run, settings.get(CacheHiddenConfig)
    if job.samples_only and job.format != "speculators":
        raise click.BadParameter("needs --format speculators", param_hint="--samples-only")
    inputs = [("--config", config_file), ("--data", cfg.data.source), ("--target", cfg.target.spec)]
    check_output(job.output, "--output", folder=True, inputs=inputs)
    check_cache_dir()
    with locked_output(job.output, "--output", debug):
        with exiting_at_once():
            from dflash.run.offline import write_run_cache  # deferred: torch

        def go() -> str:
            return write_run_cache(
                cfg,
                job.output,
                num_batches=job.num_batches,
                batches_per_shard=job.batches_per_shard,
                fmt=job.format,
                samples_only=job.samples_only,
                log=say,
            )

        echo_err(report_errors(debug, go))
    click.echo(job.output)


INSPECT_DATA = Command(
    {"inspect_data": InspectDataConfig},
    """rows json overwrite target chat_template_kwargs chat_rendering data seq_len batch_size
    heldout_fraction packing seed debug""".split(),
    help={"overwrite": OVERWRITE_JSON},
    config_help="The config file of the `train` run whose data to show (its other keys are "
    "not used).",
)


@click.command("inspect-data")
@INSPECT_DATA
def inspect_data_command(config_file: str | None, **given: Value) -> None:
    """Show the training rows as the drafter will see them: the learned tokens inside
    ⟦ ⟧, where each document begins, what packing cut or dropped. Only the target's
    tokenizer loads, so a chat template is checked in seconds before a long run."""
    debug = bool(given["debug"])
    settings = report_errors(debug, lambda: INSPECT_DATA.resolve(config_file, given))
    job = settings.get(InspectDataConfig)
    inputs = [("--config", config_file), ("--data", settings.given.get("data"))]
    overwrite = settings.run.run.overwrite
    check_output(job.json, "--json", inputs=inputs, command="inspect-data", overwrite=overwrite)
    with exiting_at_once():
        from dflash.run.inspect import inspect_data  # deferred: torch

    def go() -> dict[str, int]:
        return inspect_data(settings.run, job.rows, job.json, log=click.echo)

    report_errors(debug, go)
