"""`dflash-train`: build the config from flags, DFLASH_* variables and --config, then run.

Every train option is derived from the config tree (dflash.config): flag, type, range,
default, help and environment variable. Precedence: command-line flag > environment
variable `DFLASH_<OPTION>` > `--config` file > built-in default. Every bad value ends
as one `Error:` line and exit code 2; `--debug` shows the full traceback instead.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dflash.config import Option, config_from_options, option_map, options, values_from_mapping
from dflash.errors import DFlashError, first_line


class InputError(click.ClickException):
    """Bad user input found after parsing: one `Error:` line, exit code 2."""

    exit_code = 2


class FiniteFloat(click.ParamType):
    """A float that is a real number: `inf` and `nan` would train on NaN losses."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class CommaList(click.ParamType):
    """`1,2,3` (or a list) -> a tuple of `item` values."""

    def __init__(self, item: type) -> None:
        self.item = item
        self.name = "list"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
        parts = [str(p).strip() for p in parts if str(p).strip()]
        try:
            return tuple(self.item(p) for p in parts)
        except ValueError:
            kind = "integers" if self.item is int else "values"
            self.fail(f"{value!r} is not a comma-separated list of {kind}", param, ctx)


def _click_type(opt: Option) -> Any:
    if opt.choices is not None:
        return click.Choice(list(opt.choices))
    if opt.kind is tuple:
        return CommaList(opt.item or str)
    return {int: click.INT, float: FiniteFloat(), str: click.STRING}[opt.kind]


def _schema_option(name: str, help_: str | None = None) -> Callable:
    """The click option of config option `name`, with its DFLASH_* variable.

    Its click default is None ("not given"), so a --config file's value is only
    overridden by a flag or variable that was really set; help shows the schema default.
    """
    opt = option_map()[name]
    default = opt.default
    shown = "unset" if default is None else (
        ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
    )  # fmt: skip
    text = f"{help_ or opt.spec.help} (default: {shown})"
    common: dict[str, Any] = dict(envvar=opt.envvar, show_envvar=True, help=text, default=None)
    if opt.kind is bool:
        return click.option(f"{opt.flag}/--no-{opt.flag[2:]}", name, **common)
    return click.option(opt.flag, name, type=_click_type(opt), **common)


def read_config_file(path: Path) -> dict[str, Any]:
    """Raw mapping of a YAML, TOML or JSON config file (by suffix; YAML otherwise)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--config {str(path)!r}: cannot read ({exc.strerror})") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        elif path.suffix == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text) or {}
    except Exception as exc:  # noqa: BLE001 - any parser error becomes one line
        raise InputError(f"--config {str(path)!r}: cannot parse ({first_line(exc)})") from None
    if not isinstance(raw, dict):
        raise InputError(f"--config {str(path)!r}: expected a mapping of option names to values")
    return raw


def build_config(config_file: str | None, given: dict[str, Any]) -> Any:
    """The run's config: file values, then the flags and variables that were set."""
    values: dict[str, Any] = {}
    if config_file is not None:
        raw = read_config_file(Path(config_file))
        values = values_from_mapping(raw, f"config file {config_file}")
    values.update({k: v for k, v in given.items() if v is not None})
    return config_from_options(values)


def _report_errors(debug: bool, run: Callable[[], Any]) -> Any:
    """User errors (DFlashError) become one `Error:` line (exit 2) unless --debug."""
    try:
        return run()
    except DFlashError as exc:
        if debug:
            raise
        raise InputError(first_line(exc)) from None


class _DefaultGroup(click.Group):
    """`dflash-train` alone (or with only train flags) means `dflash-train train`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0].startswith("-") and args[0] not in ("--help", "-h", "--version")):
            args = ["train", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash-train")
def cli() -> None:
    """Train DFlash block-diffusion drafters; every pipeline phase is traced.

    Without a command, runs `train` on the embedded default (a built-in tiny target
    on the Python standard library's source; CPU, no downloads).
    """


def _train_options(func: Callable) -> Callable:
    for opt in reversed(options()):
        func = _schema_option(opt.name)(func)
    return func


_DEBUG_HELP = "Show full tracebacks instead of one-line errors."


@cli.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML, TOML or JSON file of option values: flat option names (snake_case or "
    "kebab-case) or sections as in OUTPUT_DIR/config.json, which reproduces that run. "
    "Flags and DFLASH_* variables override it.",
)
@_train_options
def train(config_file: str | None, **given: Any) -> None:
    """Train a drafter: final drafter in OUTPUT_DIR/drafter/, figures in summary.json."""
    # torch-heavy modules load here, so that --help and bad flags answer at once
    from dflash.pipeline import run_training
    from dflash.queues import PipelineError

    def log(line: str) -> None:
        click.echo(line, err=True)

    debug = bool(given.get("debug"))
    cfg = _report_errors(debug, lambda: build_config(config_file, given))
    if cfg.run.dry_run:
        from dflash.estimate import dry_run_lines

        click.echo("\n".join(_report_errors(cfg.run.debug, lambda: dry_run_lines(cfg))))
        return
    try:
        _report_errors(cfg.run.debug, lambda: run_training(cfg, log=log))
    except PipelineError as exc:
        if cfg.run.debug:
            raise
        # A stage failed at run time: one line (the traceback is in the log file), exit 1.
        raise click.ClickException(first_line(exc)) from None


def _write_json(json_path: str | None, figures: dict[str, Any]) -> None:
    if json_path == "-":
        click.echo(json.dumps(figures, indent=2))
    elif json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")


def _echo_err(line: str) -> None:
    click.echo(line, err=True)


_NEW_TOKENS_HELP = "Tokens generated at most per prompt; generation also ends at a stop token."
_TEMPERATURE_HELP = (
    "Sampling temperature; 0 decodes greedily (output identical to the target's greedy "
    "decoding), above 0 uses the speculative-sampling acceptance rule."
)


@cli.command("eval")
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
@_schema_option("data", "Corpus whose held-out split gives the prompts when --eval-data is unset.")
@_schema_option(
    "eval_prompts", "Number of prompts (with --eval-data: the first N conversations; unset: all)."
)
@_schema_option("eval_prompt_tokens", "Length of each held-out prompt, in tokens.")
@click.option("--max-new-tokens", default=256, show_default=True, type=int, help=_NEW_TOKENS_HELP)
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(),
              help=_TEMPERATURE_HELP)  # fmt: skip
@_schema_option("seed", "Seed of sampling when --temperature is above 0.")
@click.option(
    "--timing-repeats", default=1, show_default=True, type=click.IntRange(min=1),
    help="Decode each prompt this often both ways and keep the fastest times (noisy machines).",
)  # fmt: skip
@click.option(
    "--device", default="auto", show_default=True, envvar="DFLASH_DEVICE", show_envvar=True,
    help="Device for target and drafter (cpu, cuda:0, ...); auto picks cuda:0 when present.",
)  # fmt: skip
@click.option(
    "--json", "json_path", default=None, type=click.Path(dir_okay=False),
    help="Also write the figures as JSON to this file (`-` for standard output).",
)  # fmt: skip
@click.option("--debug/--no-debug", default=False, show_default=True, help=_DEBUG_HELP)
def eval_command(
    drafter_dir: str,
    target: str | None,
    eval_data: str | None,
    max_new_tokens: int,
    temperature: float,
    timing_repeats: int,
    json_path: str | None,
    device: str,
    debug: bool,
    **given: Any,
) -> None:
    """Speculative decoding with KV caches: τ (per-prompt mean and pooled), acceptance
    per block position, and the wall-clock speedup against plain greedy decoding."""
    from dflash.evaluate import EvalSettings, evaluate_drafter_dir

    def go() -> dict[str, Any]:
        cfg = config_from_options(given)
        settings = EvalSettings(
            data=cfg.data.source, eval_data=eval_data,
            num_prompts=given["eval_prompts"] if eval_data else cfg.run.eval_prompts,
            prompt_tokens=cfg.run.eval_prompt_tokens, max_new_tokens=max_new_tokens,
            temperature=temperature, seed=cfg.run.seed, timing_repeats=timing_repeats,
        )  # fmt: skip
        return evaluate_drafter_dir(Path(drafter_dir), target, settings, device, log=_echo_err)

    _write_json(json_path, _report_errors(debug, go))


@cli.command("export")
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
@click.option("--debug/--no-debug", default=False, show_default=True, help=_DEBUG_HELP)
def export_command(
    drafter_dir: str, output_dir: str, num_target_layers: int | None, debug: bool
) -> None:
    """Convert an older run's drafter into the standard DFlash format serving engines load."""
    from dflash.drafter_io import export_drafter

    def go() -> Path:
        return export_drafter(drafter_dir, output_dir, num_target_layers=num_target_layers)

    click.echo(str(_report_errors(debug, go)))


@cli.command("prepare-target")
@_schema_option(
    "target",
    "Target to prepare: builtin:tiny trains and caches the tiny LM (always with seed 0, so "
    "every run finds the same one) under $DFLASH_CACHE_DIR, else ~/.cache/dflash-train; a "
    "Hugging Face id or directory is loaded once (downloaded where the machine has internet).",
)
@click.option("--debug/--no-debug", default=False, show_default=True, help=_DEBUG_HELP)
def prepare_target(target: str | None, debug: bool) -> None:
    """Prepare (train or download) and cache a target so that `train` starts at once."""
    from dflash.target import prepare_target_spec

    def go() -> None:
        spec = config_from_options({"target": target}).target.spec
        click.echo(str(prepare_target_spec(spec, log=lambda s: click.echo(s, err=True))))

    _report_errors(debug, go)


@cli.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--debug/--no-debug", default=False, show_default=True, help=_DEBUG_HELP)
def report_command(run_dir: str, debug: bool) -> None:
    """Write RUN_DIR/report.html: curves, phase table, verdict and timeline of a run.

    Training writes it at the end; this rebuilds it (e.g. from a copied run folder).
    The page is self-contained: it opens without network.
    """
    from dflash.report import write_report

    click.echo(str(_report_errors(debug, lambda: write_report(Path(run_dir)))))


def main() -> None:
    # Run as `python -m dflash.cli` this file is __main__; the data subcommands
    # registered on the group of the imported dflash.cli.
    from dflash import cli as module

    module.cli(prog_name="dflash-train")


# The data subcommands (regenerate, cache-hidden) register themselves on `cli`.
from dflash import cli_data  # noqa: E402, F401

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
