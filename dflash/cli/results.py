"""`dflash-train eval`, `report` and `export`: what a trained drafter is worth, a run's
report, and the conversion of older drafters."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from dflash.cli.options import (
    OVERWRITE_JSON,
    Command,
    ResolvedOptions,
    check_cache_dir,
    check_output,
    debug_option,
    echo_err,
    locked_output,
    report_errors,
    server_settings,
    write_json,
)
from dflash.cli.startup import exiting_at_once
from dflash.config.commands import DeviceConfig, ExportConfig, ServerConfig
from dflash.config.schema import Value
from dflash.eval.config import EvalConfig, EvalJobConfig
from dflash.log import say
from dflash.observe.report import write_report
from dflash.summary import EvalRecord, ServedFigures
from dflash.target.served import CompletionClient

EVAL = Command(
    {"eval": EvalConfig, "eval_job": EvalJobConfig, "server": ServerConfig, "device": DeviceConfig},
    """drafter server concurrency request_timeout retries server_model target eval_data data
    eval_prompts eval_prompt_tokens chat_template_kwargs max_new_tokens temperature seed
    timing_repeats draft_sampling device dtype json overwrite otlp_endpoint otlp_protocol
    trace_file service_name debug""".split(),
    help={
        "server": "An OpenAI-compatible server running the target with a DFlash drafter (vLLM "
        "with --speculative-config): the prompts go to its /v1/completions and τ comes from "
        "the engine's own counters on /metrics (e.g. http://localhost:8000).",
        "target": "Target model to verify against: builtin:tiny, a Hugging Face directory or "
        "hub id.",
        "data": "Corpus whose held-out split gives the prompts when --eval-data is unset.",
        "eval_prompts": "Number of prompts (with --eval-data: the first N conversations; "
        "unset: all).",
        "eval_prompt_tokens": "Length of each held-out prompt, in tokens.",
        "chat_template_kwargs": "JSON object of chat-template arguments for the prompts; "
        "unset: the drafter's own (saved from its training run).",
        "seed": "Seed of sampling when --temperature is above 0.",
        "device": "Device for target and drafter (cpu, cuda:0, ...); auto picks cuda:0 when "
        "present.",
        "overwrite": OVERWRITE_JSON,
    },
    shown={"target": "the target the drafter was trained for"},
)


def _decoding(settings: ResolvedOptions) -> EvalConfig:
    """EvalConfig with the prompts the run's options give: with --eval-data, the first
    --eval-prompts conversations (unset: all), else --eval-prompts held-out windows."""
    cfg, decoding = settings.run, settings.get(EvalConfig)
    first = settings.given.get("eval_prompts") if decoding.eval_data else cfg.run.eval_prompts
    return dataclasses.replace(
        decoding,
        data=cfg.data.source,
        num_prompts=first,
        prompt_tokens=cfg.run.eval_prompt_tokens,
        seed=cfg.run.seed,
    )


@click.command("eval")
@EVAL
def eval_command(config_file: str | None, **given: Value) -> None:
    """Speculative decoding with KV caches: τ (per-prompt mean and pooled), acceptance
    per block position, and the wall-clock speedup against plain greedy decoding; with
    --server, the same figures as the serving engine measures them."""
    debug = bool(given["debug"])
    settings = report_errors(debug, lambda: EVAL.resolve(config_file, given))
    decoding = report_errors(debug, lambda: _decoding(settings))
    job, server = settings.get(EvalJobConfig), settings.get(ServerConfig)
    if job.drafter is None and server.server is None:
        raise click.UsageError("give --drafter DIR (in this process), --server URL, or both")
    target = settings.given.get("target")  # unset: the drafter's own
    inputs = [("--config", config_file), ("--drafter", job.drafter)]
    inputs += [("--eval-data", decoding.eval_data), ("--data", settings.given.get("data"))]
    inputs += [("--target", target)]
    overwrite = settings.run.run.overwrite
    check_output(job.json, "--json", inputs=inputs, command="eval", overwrite=overwrite)
    check_cache_dir()
    if server.server is not None:  # the server's 3 s probe, before seconds of imports
        client = CompletionClient(server_settings(server, job.concurrency))
        report_errors(debug, client.served_models)
    with exiting_at_once():
        from dflash.eval.evaluate import evaluate_drafter_dir, evaluate_server  # deferred: torch
        from dflash.observe.command_trace import command_trace  # deferred: torch

    def go() -> EvalRecord:
        run = settings.run.target
        kwargs = run.parsed_chat_template_kwargs if run.chat_template_kwargs else None
        drafter = Path(job.drafter) if job.drafter is not None else None
        served = None
        if server.server is not None:
            served = evaluate_server(
                server_settings(server, job.concurrency),
                drafter,
                target,
                decoding,
                log=say,
                chat_template_kwargs=kwargs,
            )
        if drafter is None:
            return EvalRecord(served=served)
        device = settings.get(DeviceConfig).device
        figures = evaluate_drafter_dir(
            drafter,
            target,
            decoding,
            device,
            log=say,
            chat_template_kwargs=kwargs,
            dtype=job.dtype,
        )
        if served is None:
            return figures
        for line in compare_lines(figures, served):
            echo_err(line)
        return dataclasses.replace(figures, served=served)

    def traced() -> EvalRecord:
        with command_trace("eval", settings.run.telemetry, say):
            return go()

    write_json(job.json, report_errors(debug, traced).to_dict())


def compare_lines(here: EvalRecord, served: ServedFigures) -> list[str]:
    """One line setting the engine's τ beside this process's."""
    mine = here.tau_pooled or 0.0
    ratio = served.tau_pooled / mine if mine else float("nan")
    here_s = here.eval_s or 0.0
    faster = here_s / served.eval_s if served.eval_s > 0 else float("nan")
    return [
        f"eval: τ pooled {served.tau_pooled:.4f} by the server vs {mine:.4f} "
        f"in process (ratio {ratio:.4f}); the server took {served.eval_s:.1f} s, this "
        f"process {here_s:.1f} s ({faster:.1f}x)"
    ]


@click.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False))
@debug_option
def report_command(run_dir: str, debug: bool | None) -> None:
    """Write RUN_DIR/report.html: curves, phase table, verdict and timeline of a run.

    Training writes it at the end; this rebuilds it (e.g. from a copied run folder).
    The page is self-contained: it opens without network.
    """
    click.echo(str(report_errors(bool(debug), lambda: write_report(Path(run_dir)))))


EXPORT = Command({"export": ExportConfig}, "drafter output num_target_layers debug".split())


@click.command("export")
@EXPORT
def export_command(config_file: str | None, **given: Value) -> None:
    """Convert an older run's drafter into the standard DFlash format serving engines load."""
    debug = bool(given["debug"])
    export = report_errors(debug, lambda: EXPORT.resolve(config_file, given)).get(ExportConfig)
    output = export.output
    inputs = [("--config", config_file), ("--drafter", export.drafter)]
    check_output(output, "--output", folder=True, inputs=inputs)
    with locked_output(output, "--output", debug):
        with exiting_at_once():
            from dflash.drafter.io import export_drafter  # deferred: torch

        def go() -> Path:
            layers = export.num_target_layers
            return export_drafter(export.drafter, output, num_target_layers=layers)

        click.echo(str(report_errors(debug, go)))
