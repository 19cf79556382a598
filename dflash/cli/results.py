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
    report_errors,
    schema_option,
    write_json,
)
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
    "--drafter", "drafter_dir", required=True, type=click.Path(exists=True, file_okay=False),
    help="Directory of a saved drafter (OUTPUT_DIR/drafter of a training run).",
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
    "--json", "json_path", default=None, type=click.Path(dir_okay=False),
    help="Also write the figures as JSON to this file (`-` for standard output).",
)  # fmt: skip
@debug_option
def eval_command(
    drafter_dir: str,
    target: str | None,
    eval_data: str | None,
    max_new_tokens: int,
    temperature: float,
    timing_repeats: int,
    draft_sampling: str,
    json_path: str | None,
    device: str,
    debug: bool,
    **given: Any,
) -> None:
    """Speculative decoding with KV caches: τ (per-prompt mean and pooled), acceptance
    per block position, and the wall-clock speedup against plain greedy decoding."""
    from dflash.eval.evaluate import evaluate_drafter_dir  # deferred: torch

    check_output(json_path, "--json")
    check_cache_dir()

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
        return evaluate_drafter_dir(Path(drafter_dir), target, settings, device, log=echo_err,
                                    chat_template_kwargs=kwargs)  # fmt: skip

    write_json(json_path, report_errors(debug, go))


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
    from dflash.drafter.io import export_drafter  # deferred: torch

    check_output(output_dir, "--output", folder=True)

    def go() -> Path:
        return export_drafter(drafter_dir, output_dir, num_target_layers=num_target_layers)

    click.echo(str(report_errors(debug, go)))
