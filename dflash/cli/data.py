"""The data subcommands of `dflash-train`: `regenerate` and `cache-hidden`."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import click

from dflash.cli.options import (
    CommaList,
    FiniteFloat,
    build_config,
    check_cache_dir,
    check_output,
    debug_option,
    device_option,
    echo_err,
    locked_output,
    report_errors,
    schema_option,
    schema_options,
)
from dflash.cli.startup import exiting_at_once
from dflash.config.settings import DataConfig, config_from_options
from dflash.offline.settings import BATCHES_PER_SHARD, RegenerateSettings
from dflash.target.served import ServerSettings

_REGEN = RegenerateSettings()  # the defaults of the regenerate options


class _RegenBar:
    """Lines done and tokens/s: a bar on a terminal; elsewhere (a log) a line every few
    seconds with lines, tokens/s and the time left."""

    EVERY_S = 5.0

    def __init__(self) -> None:
        self.bar: Any = None
        self.done = 0
        self.started = time.monotonic()
        self.last_line = -math.inf
        self.first_done: int | None = None

    def __call__(self, p: Any) -> None:
        rate = f"{p.tokens_per_s:,.0f} tokens/s"
        if sys.stderr.isatty():
            if self.bar is None:
                self.bar = click.progressbar(length=p.lines_total, label="regenerate",
                                             file=sys.stderr, show_pos=True)  # fmt: skip
                self.bar.__enter__()
                self.bar.update(self.done)
            self.bar.label = f"regenerate ({rate})"
            self.bar.update(p.lines_done - self.done)
        else:
            now = time.monotonic()
            if self.first_done is None:
                self.first_done = p.lines_done  # a resumed run's lines were there already
            if now - self.last_line >= self.EVERY_S or p.lines_done == p.lines_total:
                echo_err(f"regenerate: {p.lines_done}/{p.lines_total} lines, {rate}"
                         f"{self._eta(p.lines_done, p.lines_total, now)}")  # fmt: skip
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


@click.command("regenerate")
@schema_option("target", "Target whose own replies replace the data's.")
@click.option(
    "--data", "source", default=DataConfig.source, show_default=True,
    help="Chat JSONL ({'messages': [...]}: every assistant turn is regenerated given the "
    "conversation so far), or plain text (`embedded`, a file, a folder, JSONL with 'text'): "
    "windows whose first --prefix-tokens tokens are kept and whose continuation is "
    "regenerated. Held-out documents (same split as train) are left out.",
)  # fmt: skip
@click.option(
    "--output", required=True, type=click.Path(dir_okay=False),
    help="JSONL written in the input's shape, one line per conversation or window. An "
    "interrupted run continues it; a file of another run is refused, never overwritten.",
)  # fmt: skip
@click.option("--max-new-tokens", default=_REGEN.max_new_tokens, show_default=True, type=int,
              help="Tokens generated at most per assistant turn or text window.")  # fmt: skip
@click.option("--temperature", default=_REGEN.temperature, show_default=True,
              type=FiniteFloat(), help="Sampling temperature; 0 decodes greedily.")  # fmt: skip
@click.option(
    "--stop-token-ids", default=None, type=CommaList(int),
    help="Comma-separated token ids that end a reply; unset: the target's EOS ids.",
)  # fmt: skip
@click.option("--prefix-tokens", default=_REGEN.prefix_tokens, show_default=True, type=int,
              help="Plain text: tokens of corpus text kept as each window's prompt.")  # fmt: skip
@click.option(
    "--windows-per-document", default=None, type=click.IntRange(min=1),
    help="Plain text: at most this many windows per document, spread evenly; unset: all.",
)  # fmt: skip
@click.option("--batch-size", default=_REGEN.batch_size, show_default=True, type=int,
              help="Prompts of one length decoded together (one KV cache).")  # fmt: skip
@click.option("--chunk-lines", default=_REGEN.chunk_lines, show_default=True, type=int,
              help="Lines regenerated and written together: the resume granularity.")  # fmt: skip
@schema_option("seed", "Seed of sampling when --temperature is above 0.")
@schema_option("heldout_fraction", "Share of documents held out (as in train): not regenerated.")
@schema_option("chat_template_kwargs")
@click.option(
    "--server", default=None, metavar="URL",
    help="An OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server) serving the "
    "target: its /v1/completions writes the replies, and only --target's tokenizer loads "
    "here (e.g. http://localhost:8000).",
)  # fmt: skip
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(min=1),
              help="With --server: requests in flight at once.")  # fmt: skip
@click.option("--request-timeout", default=600.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="With --server: seconds a request may take before it is retried.")  # fmt: skip
@click.option(
    "--retries",
    default=5,
    show_default=True,
    type=click.IntRange(min=0),
    help="With --server: retries of a failed request (waits 1 s, doubling).",
)
@click.option(
    "--server-model",
    default=None,
    help="With --server: the served model to use (unset: the only one served).",
)
@device_option("the target")
@debug_option
def regenerate_command(
    target: str | None,
    source: str,
    output: str,
    device: str,
    debug: bool,
    server: str | None,
    concurrency: int,
    request_timeout: float,
    retries: int,
    server_model: str | None,
    **given: Any,
) -> None:
    """Regenerate training data with the target's own replies (the recommended recipe)."""
    check_output(output, "--output", inputs=[("--data", source), ("--target", target)])
    check_cache_dir()
    bar = _RegenBar()

    def go() -> Any:
        stops = given.pop("stop_token_ids") or ()
        picked = {"seed": given.pop("seed"), "heldout_fraction": given.pop("heldout_fraction"),
                  "chat_template_kwargs": given.pop("chat_template_kwargs")}  # fmt: skip
        known = config_from_options(picked)
        settings = RegenerateSettings(
            **given, stop_token_ids=tuple(stops), seed=known.run.seed,
            heldout_fraction=known.data.heldout_fraction,
        )  # fmt: skip
        spec = config_from_options({"target": target}).target.spec
        served = None
        if server is not None:
            served = ServerSettings(server, concurrency=concurrency, timeout_s=request_timeout,
                                    retries=retries, model=server_model)  # fmt: skip
        try:
            return regenerate_data(spec, device, source, output, settings, progress=bar,
                                   log=echo_err, chat_template_kwargs=known.target.template_kwargs,
                                   server=served)  # fmt: skip
        finally:
            bar.close()

    with locked_output(output, "--output", debug):  # before torch: a second writer at once
        with exiting_at_once():
            from dflash.run.offline import regenerate_data  # deferred: torch, so --help is quick

        report = report_errors(debug, go)
    for line in report.skipped.lines(0):
        echo_err(line)
    resumed = f", continued after line {report.resumed_from_line}" * bool(report.resumed_from_line)
    rate = report.new_tokens / report.wall_s if report.wall_s > 0 else 0.0
    echo_err(
        f"regenerate: {report.lines} lines in {report.output}{resumed}; {report.new_tokens:,} "
        f"new tokens in {report.wall_s:.1f} s ({rate:,.0f} tokens/s)"
    )
    click.echo(str(report.output))


# The train options that decide what the target computes for batch i.
_CACHE_OPTIONS = (
    "target", "target_layers", "drafter_layers", "data", "packing", "seq_len", "batch_size",
    "seed", "heldout_fraction", "use_soft_labels", "steps", "target_devices",
    "chat_template_kwargs", "chat_rendering",
)  # fmt: skip


@click.command("cache-hidden")
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False),
    help="The config file of the `train` run that will read the cache (its other keys are "
    "not used here).",
)  # fmt: skip
@click.option(
    "--output", required=True, type=click.Path(file_okay=False),
    help="Cache directory (sharded safetensors + index.json); an interrupted cache continues.",
)  # fmt: skip
@click.option(
    "--num-batches", default=None, type=click.IntRange(min=1),
    help="Batches to cache; unset: --steps (one drafter device on one rank; N devices or "
    "ranks read N times as many).",
)  # fmt: skip
@click.option("--batches-per-shard", default=BATCHES_PER_SHARD, show_default=True,
              type=click.IntRange(min=1),
              help="Batches per shard file (the resume granularity).")  # fmt: skip
@click.option(
    "--format", "fmt", type=click.Choice(["dflash", "speculators"]), default="dflash",
    show_default=True,
    help="dflash: batches of the run, for this project's trainer; speculators: one "
    "hs_{i}.safetensors file per document of the training rows in vllm-project/speculators' "
    "layout (auxiliary layers, then the last layer with --use-soft-labels), which either "
    "tool trains from (--num-batches and --batches-per-shard do not apply).",
)  # fmt: skip
@click.option(
    "--samples-only",
    is_flag=True,
    help="With --format speculators: write the documents (OUTPUT/samples.jsonl, "
    "dflash_samples.json and the Arrow dataset) without their hidden states, loading only "
    "the target's tokenizer, embedding and head, for vLLM to extract the states "
    "(tools/vllm/extract_hidden_states.py).",
)
@schema_options(_CACHE_OPTIONS)
@debug_option
def cache_hidden_command(
    config_file: str | None,
    output: str,
    num_batches: int | None,
    batches_per_shard: int,
    fmt: str,
    samples_only: bool,
    debug: bool,
    **given: Any,
) -> None:
    """Run the target once over the training batches and write their hidden states, for
    `train --hidden-cache DIR` with the same target, layer and data options."""
    if samples_only and fmt != "speculators":
        raise click.BadParameter("needs --format speculators", param_hint="--samples-only")
    cfg = report_errors(debug, lambda: build_config(config_file, given))
    inputs = [("--config", config_file), ("--data", cfg.data.source), ("--target", cfg.target.spec)]
    check_output(output, "--output", folder=True, inputs=inputs)
    check_cache_dir()
    with locked_output(output, "--output", debug):
        with exiting_at_once():
            from dflash.run.offline import write_run_cache  # deferred: torch

        def go() -> Any:
            return write_run_cache(
                cfg,
                output,
                num_batches=num_batches,
                batches_per_shard=batches_per_shard,
                fmt=fmt,
                samples_only=samples_only,
                log=echo_err,
            )

        echo_err(report_errors(debug, go))
    click.echo(output)


_INSPECT_OPTIONS = ("target", "chat_template_kwargs", "chat_rendering", "data", "seq_len",
                    "batch_size", "heldout_fraction", "packing", "seed")  # fmt: skip


@click.command("inspect-data")
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False),
    help="The config file of the `train` run whose data to show (its other keys are not used).",
)  # fmt: skip
@click.option("--rows", default=3, show_default=True, type=click.IntRange(min=0),
              help="Training rows to print.")  # fmt: skip
@click.option(
    "--json", "json_path", default=None, type=click.Path(dir_okay=False),
    help="Also write every training document as a JSON list of "
    '{"text", "tokens", "loss_mask"}.',
)  # fmt: skip
@schema_options(_INSPECT_OPTIONS)
@debug_option
def inspect_data_command(
    config_file: str | None, rows: int, json_path: str | None, debug: bool, **given: Any
) -> None:
    """Show the training rows as the drafter will see them: the learned tokens inside
    ⟦ ⟧, where each document begins, what packing cut or dropped. Only the target's
    tokenizer loads, so a chat template is checked in seconds before a long run."""
    check_output(json_path, "--json", inputs=[("--config", config_file), ("--data", given["data"])])
    with exiting_at_once():
        from dflash.run.inspect import inspect_data  # deferred: torch

    def go() -> Any:
        return inspect_data(build_config(config_file, given), rows, json_path, log=click.echo)

    report_errors(debug, go)
