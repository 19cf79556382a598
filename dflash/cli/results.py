"""`dflash-train eval`, `report` and `export`: what a trained drafter is worth, a run's
report, and the conversion of older drafters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dflash.cli.options import (
    FiniteFloat,
    check_cache_dir,
    check_output,
    debug_option,
    device_option,
    echo_err,
    locked_output,
    report_errors,
    schema_option,
    write_json,
)
from dflash.cli.startup import exiting_at_once
from dflash.config.settings import config_from_options
from dflash.eval.settings import EvalSettings
from dflash.observe.report import write_report

_NEW_TOKENS_HELP = "Tokens generated at most per prompt; generation also ends at a stop token."
_TEMPERATURE_HELP = (
    "Sampling temperature; 0 decodes greedily (output identical to the target's greedy "
    "decoding), above 0 uses the speculative-sampling acceptance rule."
)


@click.command("eval")
@click.option(
    "--drafter", "drafter_dir", default=None, type=click.Path(exists=True, file_okay=False),
    help="Directory of a saved drafter (OUTPUT_DIR/drafter of a training run), evaluated in "
    "this process. Required unless --server is given; with --server both are measured.",
)  # fmt: skip
@click.option(
    "--server", default=None, metavar="URL",
    help="An OpenAI-compatible server running the target with a DFlash drafter (vLLM with "
    "--speculative-config): the prompts go to its /v1/completions and τ comes from the "
    "engine's own counters on /metrics (e.g. http://localhost:8000).",
)  # fmt: skip
@click.option("--concurrency", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --server: requests in flight at once; 1 also measures each prompt's "
              "τ, more gives the pooled τ alone.")  # fmt: skip
@click.option("--request-timeout", default=600.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="With --server: seconds a request may take before it is retried.")  # fmt: skip
@click.option("--retries", default=2, show_default=True, type=click.IntRange(min=0),
              help="With --server: retries of a failed request (waits 1 s, doubling).")  # fmt: skip
@click.option(
    "--server-model", default=None,
    help="With --server: the served model to use (unset: the only one served).",
)  # fmt: skip
@click.option(
    "--target", default=None, envvar="DFLASH_TARGET", show_envvar=True,
    show_default="the target the drafter was trained for",
    help="Target model to verify against: builtin:tiny, a Hugging Face directory or hub id.",
)  # fmt: skip
@click.option(
    "--eval-data", default=None, type=click.Path(exists=True, dir_okay=False),
    help="Chat JSONL of prompts ({'messages': [...]}, ShareGPT 'conversations' or "
    "{'turns': [...]}): each conversation up to its last user turn, through the chat "
    "template with the generation prompt. Without it, held-out windows of --data.",
)  # fmt: skip
@schema_option("data", "Corpus whose held-out split gives the prompts when --eval-data is unset.")
@schema_option(
    "eval_prompts", "Number of prompts (with --eval-data: the first N conversations; unset: all)."
)
@schema_option("eval_prompt_tokens", "Length of each held-out prompt, in tokens.")
@schema_option(
    "chat_template_kwargs",
    "JSON object of chat-template arguments for the prompts; unset: the drafter's own "
    "(saved from its training run).",
)
@click.option("--max-new-tokens", default=EvalSettings.max_new_tokens, show_default=True, type=int,
              help=_NEW_TOKENS_HELP)  # fmt: skip
@click.option("--temperature", default=EvalSettings.temperature, show_default=True,
              type=FiniteFloat(), help=_TEMPERATURE_HELP)  # fmt: skip
@schema_option("seed", "Seed of sampling when --temperature is above 0.")
@click.option(
    "--timing-repeats", default=EvalSettings.timing_repeats, show_default=True,
    type=click.IntRange(min=1),
    help="Decode each prompt this often both ways and keep the fastest times (noisy machines).",
)  # fmt: skip
@click.option(
    "--draft-sampling", type=click.Choice(["greedy", "sample"]), default="greedy",
    show_default=True,
    help="At --temperature > 0: greedy drafts accepted with probability p(x) (the DFlash "
    "authors' rule and vLLM's default), or drafts sampled from the drafter and accepted "
    "with min(1, p/q). Both keep the target's distribution; their τ differ.",
)  # fmt: skip
@device_option("target and drafter")
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
    show_default=True,
    help="Dtype of the target and the drafter here; auto: bf16 on CUDA, fp32 elsewhere. "
    "Give the dtype the engine serves in to compare τ with it (a bf16 save is evaluated "
    "in fp32 under auto on a CPU).",
)  # fmt: skip
@click.option(
    "--json", "json_path", default=None, type=click.Path(dir_okay=False),
    help="Also write the figures as JSON to this file (`-` for standard output).",
)  # fmt: skip
@debug_option
def eval_command(
    drafter_dir: str | None,
    server: str | None,
    concurrency: int,
    request_timeout: float,
    retries: int,
    server_model: str | None,
    target: str | None,
    eval_data: str | None,
    max_new_tokens: int,
    temperature: float,
    timing_repeats: int,
    draft_sampling: str,
    json_path: str | None,
    device: str,
    dtype: str,
    debug: bool,
    **given: Any,
) -> None:
    """Speculative decoding with KV caches: τ (per-prompt mean and pooled), acceptance
    per block position, and the wall-clock speedup against plain greedy decoding; with
    --server, the same figures as the serving engine measures them."""
    if drafter_dir is None and server is None:
        raise click.UsageError("give --drafter DIR (in this process), --server URL, or both")
    inputs = [("--drafter", drafter_dir), ("--eval-data", eval_data)]
    inputs += [("--data", given["data"]), ("--target", target)]
    check_output(json_path, "--json", inputs=inputs)
    check_cache_dir()
    with exiting_at_once():
        from dflash.eval.evaluate import evaluate_drafter_dir, evaluate_server  # deferred: torch
        from dflash.target.served import ServerSettings  # deferred: beside eval, torch

    def go() -> dict[str, Any]:
        cfg = config_from_options(given)
        settings = EvalSettings(
            data=cfg.data.source, eval_data=eval_data,
            num_prompts=given["eval_prompts"] if eval_data else cfg.run.eval_prompts,
            prompt_tokens=cfg.run.eval_prompt_tokens, max_new_tokens=max_new_tokens,
            temperature=temperature, seed=cfg.run.seed, timing_repeats=timing_repeats,
            draft_sampling=draft_sampling,
        )  # fmt: skip
        kwargs = cfg.target.template_kwargs if cfg.target.chat_template_kwargs else None
        drafter = Path(drafter_dir) if drafter_dir is not None else None
        served = None
        if server is not None:
            served_settings = ServerSettings(server, concurrency=concurrency,
                                             timeout_s=request_timeout, retries=retries,
                                             model=server_model)  # fmt: skip
            served = evaluate_server(served_settings, drafter, target, settings, log=echo_err,
                                     chat_template_kwargs=kwargs)  # fmt: skip
        if drafter is None:
            return {**served, "served": served} if served is not None else {}
        figures = evaluate_drafter_dir(drafter, target, settings, device, log=echo_err,
                                       chat_template_kwargs=kwargs, dtype=dtype)  # fmt: skip
        if served is None:
            return figures
        for line in compare_lines(figures, served):
            echo_err(line)
        return {**figures, "served": served}

    write_json(json_path, report_errors(debug, go))


def compare_lines(here: dict[str, Any], served: dict[str, Any]) -> list[str]:
    """One line setting the engine's τ beside this process's."""
    ratio = served["tau_pooled"] / here["tau_pooled"] if here["tau_pooled"] else float("nan")
    faster = here["eval_s"] / served["eval_s"] if served["eval_s"] > 0 else float("nan")
    return [
        f"eval: τ pooled {served['tau_pooled']:.4f} by the server vs {here['tau_pooled']:.4f} "
        f"in process (ratio {ratio:.4f}); the server took {served['eval_s']:.1f} s, this "
        f"process {here['eval_s']:.1f} s ({faster:.1f}x)"
    ]


@click.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False))
@debug_option
def report_command(run_dir: str, debug: bool) -> None:
    """Write RUN_DIR/report.html: curves, phase table, verdict and timeline of a run.

    Training writes it at the end; this rebuilds it (e.g. from a copied run folder).
    The page is self-contained: it opens without network.
    """
    click.echo(str(report_errors(debug, lambda: write_report(Path(run_dir)))))


@click.command("export")
@click.option(
    "--drafter", "drafter_dir", required=True, type=click.Path(exists=True, file_okay=False),
    help="Drafter directory in the first dflash-train layout (runs before the DFlash format).",
)  # fmt: skip
@click.option(
    "--output", "output_dir", required=True, type=click.Path(file_okay=False),
    help="Directory for the standard DFlash checkpoint (config.json, model.safetensors).",
)  # fmt: skip
@click.option(
    "--num-target-layers", default=None, type=click.IntRange(min=1),
    help="Decoder layers of the drafter's target; unset loads the target (CPU) to count them.",
)  # fmt: skip
@debug_option
def export_command(
    drafter_dir: str, output_dir: str, num_target_layers: int | None, debug: bool
) -> None:
    """Convert an older run's drafter into the standard DFlash format serving engines load."""
    check_output(output_dir, "--output", folder=True, inputs=[("--drafter", drafter_dir)])
    with locked_output(output_dir, "--output", debug):
        with exiting_at_once():
            from dflash.drafter.io import export_drafter  # deferred: torch

        def go() -> Path:
            return export_drafter(drafter_dir, output_dir, num_target_layers=num_target_layers)

        click.echo(str(report_errors(debug, go)))
