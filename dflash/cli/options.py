"""Option types, options derived from the config tree, and the one-line errors.

Every train option comes from the config tree (dflash.config.settings): flag, type,
range, default, help and environment variable. Precedence: command-line flag >
environment variable `DFLASH_<OPTION>` > `--config` file > built-in default. Every bad
value ends as one `Error:` line and exit code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from dflash.config.schema import Option
from dflash.config.settings import (
    TrainConfig,
    config_from_options,
    option_map,
    options,
    read_values,
)
from dflash.errors import DFlashError, first_line
from dflash.files import cache_dir, write_text_atomic
from dflash.run.folder import FolderLock
from dflash.run.outputs import Output, output_problem, write_problem


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


def schema_option(name: str, help_: str | None = None) -> Callable:
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
    except UnicodeDecodeError as exc:
        raise InputError(
            f"--config {str(path)!r}: not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from None
    try:
        if path.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)  # refuses a duplicate key itself
        elif path.suffix == ".json":
            raw = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        else:
            raw = _load_yaml(text)
    except Exception as exc:  # noqa: BLE001 - any parser error becomes one line
        raise InputError(f"--config {str(path)!r}: cannot parse ({first_line(exc)})") from None
    if not isinstance(raw, dict):
        raise InputError(f"--config {str(path)!r}: expected a mapping of option names to values")
    return raw


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON objects whose keys repeat are refused: json keeps the last one silently."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def _load_yaml(text: str) -> Any:
    """yaml.safe_load, refusing a mapping whose keys repeat (safe_load keeps the last)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            for key in keys:
                if keys.count(key) > 1:
                    raise ValueError(f"key {key!r} appears twice (line {node.start_mark.line + 1})")
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader


def build_config(config_file: str | None, given: dict[str, Any]) -> TrainConfig:
    """The run's config: file values, then the flags and variables that were set. The
    invocation flags a file holds (an older run's config.json) are left out, with one
    line saying so."""
    values: dict[str, Any] = {}
    if config_file is not None:
        source = f"config file {config_file}"
        found = read_values(read_config_file(Path(config_file)), source)
        if found.left_out:
            flags = ", ".join(option_map()[name].flag for name in found.left_out)
            echo_err(
                f"{source}: left out {flags}: flags of one invocation are not read from a "
                "file (give them on the command line)"
            )
        values = found.values
    values.update({k: v for k, v in given.items() if v is not None})
    return config_from_options(values)


def report_errors(debug: bool, run: Callable[[], Any]) -> Any:
    """User errors (DFlashError) become one `Error:` line (exit 2) unless --debug."""
    try:
        return run()
    except DFlashError as exc:
        if debug:
            raise
        raise InputError(first_line(exc)) from None


def check_output(
    value: str | None,
    flag: str,
    folder: bool = False,
    *,
    inputs: Iterable[tuple[str, str | None]] = (),
    own_run: str | None = None,
) -> None:
    """An output path the command will write, checked before any model loads: one line
    naming it (exit 2) when it cannot be written, is one of the command's `inputs`
    ((flag, path) pairs) or inside one, or is a file a run writes (dflash.run.outputs;
    `own_run`: the folder of the run this command is). `-` (standard output) and None
    pass."""
    if value is None or value == "-":
        return
    why = output_problem(Output(flag, value, folder=folder), inputs, own_run)
    if why is not None:
        raise InputError(why)


def check_cache_dir() -> None:
    """The cache folder (built-in targets, regenerated data) must take writes: found out
    now, not after minutes of target preparation."""
    why = write_problem(cache_dir(), folder=True)
    if why is not None:
        raise InputError(f"DFLASH_CACHE_DIR {str(cache_dir())!r} cannot be written: {why}")


@contextmanager
def locked_output(value: str, flag: str, debug: bool) -> Iterator[None]:
    """Holds the lock of an output only one process may write at a time (`regenerate`,
    `cache-hidden`, `export`) for the block, taken before any work: a second writer is
    one line naming the first (pid and host)."""
    lock = FolderLock.for_output(value, flag)
    try:
        report_errors(debug, lock.acquire)
    except OSError as exc:  # the checks passed, then the folder went away or read-only
        raise InputError(f"{flag} {value!r} cannot be locked: {exc.strerror}") from None
    try:
        yield
    finally:
        lock.release()


def schema_options(names: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """The click options of config options `names`, in that order."""

    def add(func: Callable) -> Callable:
        for name in reversed(names):
            func = schema_option(name)(func)
        return func

    return add


def train_options(func: Callable) -> Callable:
    """Every option of the config tree, in declaration order."""
    return schema_options(tuple(opt.name for opt in options()))(func)


DEBUG_HELP = "Show full tracebacks instead of one-line errors."
debug_option = click.option("--debug/--no-debug", default=False, show_default=True, help=DEBUG_HELP)


def device_option(what: str) -> Callable:
    """`--device` of the commands that run one model on one device (not `train`)."""
    return click.option(
        "--device", default="auto", show_default=True, envvar="DFLASH_DEVICE", show_envvar=True,
        help=f"Device for {what} (cpu, cuda:0, ...); auto picks cuda:0 when present.",
    )  # fmt: skip


def echo_err(line: str) -> None:
    click.echo(line, err=True)


def write_json(json_path: str | None, figures: dict[str, Any]) -> None:
    """Figures as JSON to `json_path` (`-`: standard output; None: nowhere), replaced
    atomically. When the file cannot be written after all (a full disk), the figures go
    to standard output before the one-line error: minutes of measuring are not lost."""
    text = json.dumps(figures, indent=2)
    if json_path == "-":
        click.echo(text)
    elif json_path:
        try:
            write_text_atomic(json_path, text + "\n")
        except OSError as exc:
            click.echo(text)
            raise InputError(
                f"--json {json_path!r} could not be written ({exc.strerror}): the figures "
                "are on standard output"
            ) from None
