"""`dflash-train`: build the config from flags, DFLASH_* variables and --config, then run.

Precedence: command-line flag > environment variable `DFLASH_<OPTION>` >
`--config` file > built-in default. Every bad value ends as one `Error:` line and
exit code 2; `--debug` shows the full traceback instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dflash.config import ConfigError, config_from_options, option_default


class InputError(click.ClickException):
    """Bad user input found after parsing: one `Error:` line, exit code 2."""

    exit_code = 2


def _layer_ids(ctx: click.Context, param: click.Parameter, value: Any) -> tuple[int, ...] | None:
    if value is None or value == "":
        return None
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        return tuple(int(str(p).strip()) for p in parts)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None


def _device_list(ctx: click.Context, param: click.Parameter, value: Any) -> tuple[str, ...]:
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return tuple(str(p).strip() for p in parts if str(p).strip())


# Option name -> (click type, full-sentence help with units). Defaults come from TrainConfig.
_TRAIN_OPTIONS: dict[str, tuple[Any, str]] = {
    "steps": (int, "Number of optimizer steps to train, counted from step 0 (also when resuming)."),
    "batch_size": (int, "Packed rows per training batch."),
    "seq_len": (int, "Tokens per packed row."),
    "lr": (float, "Peak learning rate of AdamW, reached after the warmup."),
    "seed": (int, "Seed of the data order, anchor sampling and drafter initialization."),
    "output_dir": (
        str,
        "Directory for the final drafter (drafter/), checkpoints (checkpoints/) and summary.json.",
    ),
    "resume": (
        str,
        "Continue from a checkpoint directory, or `latest` for the newest one under "
        "OUTPUT_DIR/checkpoints.",
    ),
    "data": (
        str,
        "Training text: `embedded` (the Python standard library source), a text file, a folder, "
        "or JSONL with a `text` field or chat `messages` (loss on assistant turns only).",
    ),
    "target": (str, "Target model: `builtin:tiny`, a local Hugging Face directory or a hub id."),
    "target_layers": (
        str,
        "Comma-separated 0-based target layer ids to capture; unset spreads as many as "
        "--drafter-layers evenly from layer 1 to L-3.",
    ),
    "drafter_layers": (int, "Number of drafter decoder layers."),
    "block_size": (
        int,
        "Tokens per drafted block (the anchor plus BLOCK_SIZE-1 predictions); at least 2.",
    ),
    "num_anchors": (int, "Anchors (blocks) sampled per sequence in each step; at least 1."),
    "loss_decay_gamma": (
        float,
        "γ of the position weight exp(-(k-1)/γ); unset picks it from the block size "
        "(4 for 8, 5 for 10, 7 for 16).",
    ),
    "use_soft_labels": (bool, "Also distill from the target's logits (KL), not only hard labels."),
    "kl_temperature": (float, "Softmax temperature of the distillation KL; must be > 0."),
    "kl_weight": (float, "Share of the KL term in the loss when soft labels are on, in [0, 1]."),
    "streak_alpha": (
        float,
        "Streak-aware weighting strength α in [0, 1]; unset turns streak weighting off.",
    ),
    "warmup_steps": (int, "Steps of linear learning-rate warmup before the cosine decay."),
    "grad_clip": (float, "Clip the global gradient norm to this value; 0 disables clipping."),
    "weight_decay": (float, "AdamW decoupled weight decay."),
    "save_every": (int, "Write a checkpoint every this many steps (0: only at the end)."),
    "eval_prompts": (
        int,
        "Held-out prompts on which τ is measured at the end (0 skips evaluation).",
    ),
    "eval_new_tokens": (int, "Tokens generated per evaluation prompt."),
    "eval_prompt_tokens": (int, "Length of each evaluation prompt, in tokens."),
    "target_devices": (
        str,
        "Comma-separated devices running the target (cpu, cuda:0, ...); `auto`: cpu without "
        "GPUs, else the first half of the GPUs (one GPU serves both sides).",
    ),
    "drafter_devices": (
        str,
        "Comma-separated devices training drafter replicas; `auto`: cpu without GPUs, else "
        "the second half of the GPUs.",
    ),
    "batch_queue_size": (int, "Batches prefetched ahead of the target threads."),
    "hs_queue_size": (int, "Hidden-state batches buffered between target and drafter threads."),
    "otlp_endpoint": (
        str,
        "OTLP collector address (e.g. localhost:4317); unset sends nothing over the network.",
    ),
    "otlp_protocol": (
        click.Choice(["grpc", "http"]),
        "OTLP transport: grpc (port 4317) or http/protobuf (port 4318); unset uses "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else grpc.",
    ),
    "trace_level": (
        click.Choice(["off", "step", "phase"]),
        "Spans exported: none, one per batch and drafter step, or every phase.",
    ),
    "trace_sample_ratio": (
        float,
        "Share of batch traces exported, in [0, 1]; interval tables always count every phase. "
        "Unset uses OTEL_TRACES_SAMPLER[_ARG], else 1.0.",
    ),
    "trace_file": (
        str,
        "Also write spans to this file as OTLP JSON, one request per line (Jaeger loads it).",
    ),
    "cuda_timing": (
        click.Choice(["off", "sync", "events"]),
        "Device timing of phases: host wall time, synchronize at phase ends, or CUDA events.",
    ),
    "profile_interval": (float, "Seconds between interval tables in the log."),
    "service_name": (
        str,
        "OpenTelemetry service.name; unset uses OTEL_SERVICE_NAME, else dflash-train.",
    ),
}
_CALLBACKS: dict[str, Callable] = {
    "target_layers": _layer_ids,
    "target_devices": _device_list,
    "drafter_devices": _device_list,
}
_TRAIN_OPTION_NAMES = set(_TRAIN_OPTIONS) | {"debug"}


def _envvar(name: str) -> str:
    return f"DFLASH_{name.upper()}"


def _option(name: str, help_: str | None = None) -> Callable:
    """click option for config option `name`, with its DFLASH_* variable and default."""
    type_, train_help = _TRAIN_OPTIONS[name]
    flag = "--" + name.replace("_", "-")
    default = option_default(name)
    common = dict(
        envvar=_envvar(name),
        show_envvar=True,
        help=help_ or train_help,
        callback=_CALLBACKS.get(name),
    )
    if type_ is bool:
        return click.option(
            f"{flag}/--no-{flag[2:]}", name, default=default, show_default=True, **common
        )
    shown = True if default is not None else "unset"
    return click.option(flag, name, type=type_, default=default, show_default=shown, **common)


def _check_file_value(param: click.Parameter, key: str, value: Any) -> None:
    """Config files are typed: 1.5 for an integer option is an error, not a silent 1."""
    kind = param.type
    ok = True
    if isinstance(kind, click.types.BoolParamType) or getattr(param, "is_flag", False):
        ok = isinstance(value, bool)
    elif isinstance(kind, click.types.IntParamType):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(kind, click.types.FloatParamType):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif key == "target_layers":
        ok = isinstance(value, (str, list)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (str, list)) if key.endswith("devices") else isinstance(value, str)
    if not ok:
        want = kind.name if not getattr(param, "is_flag", False) else "boolean"
        raise InputError(f"config key {key!r}: expected {want}, got {value!r}")


def read_config_file(path: Path) -> dict[str, Any]:
    """Raw mapping of a YAML or TOML config file (by suffix; YAML otherwise)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--config {str(path)!r}: cannot read ({exc.strerror})") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text) or {}
    except Exception as exc:  # noqa: BLE001 - any parser error becomes one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"--config {str(path)!r}: cannot parse ({first})") from None
    if not isinstance(raw, dict):
        raise InputError(f"--config {str(path)!r}: expected a mapping of option names to values")
    return raw


def _load_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Eager: the file's values become click defaults, below flags and DFLASH_* variables."""
    if value is None:
        return None
    params = {p.name: p for p in ctx.command.params}
    defaults: dict[str, Any] = {}
    for key, item in read_config_file(Path(value)).items():
        name = str(key).replace("-", "_")
        if name not in _TRAIN_OPTION_NAMES or name not in params:
            raise InputError(f"config file {value}: unknown key {key!r}")
        _check_file_value(params[name], name, item)
        if isinstance(item, list):
            item = ",".join(map(str, item))
        defaults[name] = item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _report_errors(debug: bool, run: Callable[[], Any]) -> Any:
    """Known bad-input errors become one `Error:` line (exit 2) unless --debug."""
    from dflash.checkpoint import CheckpointError
    from dflash.data import DataError
    from dflash.devices import DeviceError
    from dflash.distributed import DistributedError
    from dflash.drafter import DrafterError
    from dflash.objective import ObjectiveError
    from dflash.observe import ObserveError
    from dflash.target import TargetError

    known = (ConfigError, DataError, CheckpointError, DeviceError, TargetError, DrafterError)
    known += (ObjectiveError, DistributedError, ObserveError)
    try:
        return run()
    except known as exc:
        if debug:
            raise
        raise InputError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


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
    for name in reversed(list(_TRAIN_OPTIONS)):
        func = _option(name)(func)
    return func


_DEBUG_HELP = "Show full tracebacks instead of one-line errors."


@cli.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    is_eager=True,
    callback=_load_config,
    help="YAML or TOML file of option values (keys are option names, snake_case or "
    "kebab-case); flags and DFLASH_* variables override it.",
)
@_train_options
@click.option(
    "--debug/--no-debug", default=False, envvar="DFLASH_DEBUG", show_envvar=True,
    show_default=True, help=_DEBUG_HELP,
)  # fmt: skip
def train(config_file: str | None, debug: bool, **options: Any) -> None:
    """Train a drafter: final drafter in OUTPUT_DIR/drafter/, figures in summary.json."""
    from dflash.distributed import dist_info_from_env
    from dflash.observe import start_observer
    from dflash.pipeline import PipelineError, run_pipeline

    def log(line: str) -> None:
        click.echo(line, err=True)

    def go() -> None:
        cfg = config_from_options({**options, "debug": debug})
        info = dist_info_from_env()
        observer = start_observer(cfg.telemetry, info.rank, info.world_size)
        try:
            run_pipeline(cfg, log=log, telemetry=observer, on_start=observer.attach)
        finally:
            observer.close(log, gather_ranks=False)  # no-op after a normal finish

    try:
        _report_errors(debug, go)
    except PipelineError as exc:
        if debug:
            raise
        # A stage failed at run time: one line (the traceback is in the log file), exit 1.
        raise click.ClickException(str(exc).splitlines()[0]) from None


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
@_option("data", "Corpus whose held-out split gives the prompts (same rules as for train).")
@_option("eval_prompts", "Number of held-out prompts.")
@_option("eval_new_tokens", "Tokens generated per prompt.")
@_option("eval_prompt_tokens", "Length of each prompt, in tokens.")
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
    data: str,
    eval_prompts: int,
    eval_new_tokens: int,
    eval_prompt_tokens: int,
    device: str,
    json_path: str | None,
    debug: bool,
) -> None:
    """Speculative decoding of held-out prompts: τ and acceptance per block position."""
    from dflash.trainer import evaluate_drafter_dir

    def go() -> dict[str, Any]:
        return evaluate_drafter_dir(
            Path(drafter_dir), target, data, eval_prompts, eval_new_tokens, eval_prompt_tokens,
            device, log=lambda line: click.echo(line, err=True),
        )  # fmt: skip

    figures = _report_errors(debug, go)
    if json_path == "-":
        click.echo(json.dumps(figures, indent=2))
    elif json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")


@cli.command("prepare-target")
@_option(
    "target",
    "Target to prepare: builtin:tiny trains and caches the tiny LM (always with seed 0, so "
    "every run finds the same one) under $DFLASH_CACHE_DIR, else ~/.cache/dflash-train; a "
    "Hugging Face id or directory is loaded once (downloaded where the machine has internet).",
)
@click.option("--debug/--no-debug", default=False, show_default=True, help=_DEBUG_HELP)
def prepare_target(target: str, debug: bool) -> None:
    """Prepare (train or download) and cache a target so that `train` starts at once."""
    from dflash.trainer import prepare_target_spec

    def go() -> None:
        click.echo(str(prepare_target_spec(target, log=lambda s: click.echo(s, err=True))))

    _report_errors(debug, go)


def main() -> None:
    cli(prog_name="dflash-train")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
