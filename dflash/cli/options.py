"""Option types, the options of every command, and the one-line errors.

Every option of every command is declared with `setting` (dflash.config.schema): the
training run's in dflash.config.settings, the other commands' with the components that
read them. `Command` gives a command its options from those declarations: flag, type,
range, default, help and environment variable `DFLASH_<OPTION>` (an option two commands
share reads the same variable). Precedence: command-line flag > environment variable >
`--config` file > built-in default. Every bad value ends as one `Error:` line naming it
(the flag, the variable or the file's key) and exit code 2, before any model loads;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import click
from click.core import ParameterSource

from dflash.config.commands import ServerConfig
from dflash.config.schema import FileValues, Json, Option, Schema, Section, Value
from dflash.config.settings import TrainConfig, config_from_options, option_map, read_values
from dflash.errors import DFlashError, first_line
from dflash.files import cache_dir, special_file, write_failure, write_output
from dflash.run.folder import FolderLock
from dflash.run.outputs import Output, output_problem, write_problem
from dflash.summary import JSON
from dflash.target.served import ServerSettings


class InputError(click.ClickException):
    """Bad user input found after parsing: one `Error:` line, exit code 2."""

    exit_code = 2


class FiniteFloat(click.ParamType):
    """A float that is a real number: `inf` and `nan` would train on NaN losses."""

    name = "float"

    # Any: what click hands over (a flag's text, a default, a config file's value)
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

    # Any: what click hands over (a flag's text, a default, a config file's value)
    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
        parts = [str(p).strip() for p in parts if str(p).strip()]
        try:
            return tuple(self.item(p) for p in parts)
        except ValueError:
            kind = "integers" if self.item is int else "values"
            self.fail(f"{value!r} is not a comma-separated list of {kind}", param, ctx)


def _click_type(opt: Option) -> click.ParamType:
    if opt.choices is not None:
        return click.Choice(list(opt.choices))
    if opt.kind is tuple:
        return CommaList(opt.item or str)
    return {int: click.INT, float: FiniteFloat(), str: click.STRING}[opt.kind]


def _shown_default(opt: Option) -> str:
    if opt.required:
        return "required"
    if opt.default is None or opt.default == ():
        return "default: unset"
    value = opt.default
    return "default: " + (",".join(map(str, value)) if isinstance(value, tuple) else str(value))


def schema_option(opt: Option, help_: str | None = None, shown: str | None = None) -> Callable:
    """The click option of a declared option, with its DFLASH_* variable.

    Its click default is None ("not given"), so a --config file's value is only
    overridden by a flag or variable that was really set; help shows the declared
    default (or `shown`, where a command reads the option's absence otherwise).
    """
    default = f"default: {shown}" if shown is not None else _shown_default(opt)
    text = f"{help_ or opt.spec.help} ({default})"
    # Any: click.option's keywords, each of its own type
    common: dict[str, Any] = dict(envvar=opt.envvar, show_envvar=True, help=text, default=None)
    if opt.kind is bool:
        return click.option(f"{opt.flag}/--no-{opt.flag[2:]}", opt.name, **common)
    if opt.spec.repeatable:  # `--report-to a,b --report-to c`: one list, each name once
        common.update(multiple=True, callback=_joined)
    return click.option(opt.flag, opt.name, type=_click_type(opt), **common)


def _joined(
    ctx: click.Context, param: click.Parameter, value: tuple[tuple[Value, ...], ...] | None
) -> tuple[Value, ...] | None:
    """The lists of a repeated flag as one (None, "not given", when it was not)."""
    items = [item for part in value or () for item in part]
    return tuple(dict.fromkeys(items)) if items else None


CONFIG_HELP = (
    "YAML, TOML or JSON file of option values: flat option names (snake_case or kebab-case) "
    "or sections; a train config or a run's config.json may be given (the options this "
    "command lacks are not used). Flags and DFLASH_* variables override it."
)

OVERWRITE_JSON = (
    "Replace a --json file that this command did not write (one it wrote, as its record "
    "beside it says, is replaced anyway); without it such a file is refused."
)

S = TypeVar("S", bound=Section)
T = TypeVar("T")


@dataclass(frozen=True)
class ResolvedOptions:
    """What one command was given: the training run's options it shares (`run`, built
    whole as `train` would build it), its own sections, and every value that a flag, a
    variable or the config file set (`given`: absent where the default applies)."""

    run: TrainConfig
    sections: dict[str, Section]
    given: dict[str, Value]

    def get(self, cls: type[S]) -> S:
        (found,) = (s for s in self.sections.values() if type(s) is cls)
        return cast(S, found)


class Command:
    """The options of one command, all declared with `setting`: its own `sections` and
    the training run's options it reads, in `order` (as --help lists them). `help` and
    `shown` give a run option the help line and shown default it has in this command.
    Used as a decorator, it adds `--config` and every option to the click command."""

    def __init__(
        self,
        sections: Mapping[str, type[Section]],
        order: Iterable[str],
        *,
        help: Mapping[str, str] | None = None,
        shown: Mapping[str, str] | None = None,
        config_help: str = CONFIG_HELP,
    ) -> None:
        self.own = Schema(sections)
        self.order = tuple(order)
        self.help, self.shown = dict(help or {}), dict(shown or {})
        self.config_help = config_help
        missing = set(self.own.by_name) - set(self.order)
        assert not missing, f"options left out of the order: {sorted(missing)}"

    def option(self, name: str) -> Option:
        return self.own.by_name.get(name) or option_map()[name]

    def __call__(self, func: Callable) -> Callable:
        for name in reversed(self.order):
            func = schema_option(self.option(name), self.help.get(name), self.shown.get(name))(func)
        config = click.option(
            "--config", "config_file", type=click.Path(dir_okay=False), help=self.config_help
        )
        return config(func)

    def resolve(self, config_file: str | None, given: Mapping[str, Value]) -> ResolvedOptions:
        """The command's settings: the config file's values, then the flags and variables
        that were set, each checked where it came from (one line naming the flag, the
        variable or the file's key), before any model loads."""
        own, run = self._file_values(config_file) if config_file is not None else ({}, {})
        ctx = click.get_current_context()
        for name, value in given.items():
            if value is None:
                continue
            from_env = ctx.get_parameter_source(name) is ParameterSource.ENVIRONMENT
            origin = self.option(name).envvar if from_env else None
            (own if name in self.own.by_name else run)[name] = (value, origin)
        for values, declared in ((own, self.own.by_name), (run, option_map())):
            for name, (value, origin) in values.items():
                declared[name].validate(value, origin)
        for opt in self.own.options:
            if opt.required and opt.name not in own:
                raise click.UsageError(f"Missing option '{opt.flag}'.")
        own_values = {name: value for name, (value, _) in own.items()}
        run_values = {name: value for name, (value, _) in run.items()}
        return ResolvedOptions(
            config_from_options(run_values),
            self.own.build(own_values),
            {**run_values, **own_values},
        )

    def _file_values(self, config_file: str) -> tuple[_Found, _Found]:
        """(value, where it was written) of every option a config file sets, this
        command's own (flat or in their sections) and then a run's. The invocation flags
        it holds are left out, with one line saying so."""
        raw = read_config_file(Path(config_file))
        source = f"config file {config_file}"
        mine = {k: v for k, v in raw.items() if self.own.holds(k, v)}
        own = self.own.read(mine, source)
        run = read_values({k: v for k, v in raw.items() if k not in mine}, source)
        left_out = [self.own.by_name[n] for n in own.left_out]
        left_out += [option_map()[n] for n in run.left_out]
        if left_out:
            echo_err(
                f"{source}: left out {', '.join(opt.flag for opt in left_out)}: flags of one "
                "invocation are not read from a file (give them on the command line)"
            )
        return _found(own, source), _found(run, source)


_Found = dict[str, tuple[Value, str | None]]  # option -> (value, where it came from)


def _found(values: FileValues, source: str) -> _Found:
    return {
        name: (value, f"{source}, key {values.keys[name]!r}")
        for name, value in values.values.items()
    }


def read_config_file(path: Path) -> dict[str, Json]:
    """Raw mapping of a YAML, TOML or JSON config file (by suffix; YAML otherwise). A
    FIFO or device is refused unread: reading a FIFO waits for a writer."""
    kind = special_file(path)
    if kind is not None:
        raise InputError(f"--config {str(path)!r}: {kind}, not a regular file")
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


def _no_duplicate_keys(pairs: list[tuple[str, Json]]) -> dict[str, Json]:
    """JSON objects whose keys repeat are refused: json keeps the last one silently."""
    seen: dict[str, Json] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def _load_yaml(text: str) -> Json:
    """yaml.safe_load, refusing a mapping whose keys repeat (safe_load keeps the last)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Json, Json]:
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            for key in keys:
                if keys.count(key) > 1:
                    raise ValueError(f"key {key!r} appears twice (line {node.start_mark.line + 1})")
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader


def report_errors(debug: bool, run: Callable[[], T]) -> T:
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
    command: str | None = None,
    overwrite: bool = False,
) -> None:
    """An output path the command will write, checked before any model loads: one line
    naming it (exit 2) when it cannot be written, is one of the command's `inputs`
    ((flag, path) pairs) or inside one, is a file a run writes (dflash.run.outputs;
    `own_run`: the folder of the run this command is), or (`command`) is a file that
    command did not write, unless `overwrite`. `-` (standard output) and None pass."""
    if value is None or value == "-":
        return
    output = Output(flag, value, folder=folder, command=command, overwrite=overwrite)
    why = output_problem(output, inputs, own_run)
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


debug_option = schema_option(option_map()["debug"])


def server_settings(server: ServerConfig, concurrency: int) -> ServerSettings:
    """The client settings of `--server` and the command's own `--concurrency`."""
    assert server.server is not None
    return ServerSettings(
        server.server,
        concurrency=concurrency,
        timeout_s=server.request_timeout,
        retries=server.retries,
        model=server.server_model,
    )


# DFLASH_* variables that are not options: read by dflash itself (the cache folder), by
# the scripts (bootstrap's venvs, docker compose's user and steps, llama.cpp's build) and
# by the tests (DFLASH_REQUIRE_*, the binaries *_BIN, the report's screenshot).
NOT_OPTIONS = (
    "DFLASH_CACHE_DIR",
    "DFLASH_VENV",
    "DFLASH_DEPS_VENV",
    "DFLASH_UID",
    "DFLASH_GID",
    "DFLASH_TRAIN_STEPS",
    "DFLASH_LLAMA_NATIVE",
    "DFLASH_REPORT_SCREENSHOT",
    "DFLASH_VLLM_TEST_RUN",
)


def unknown_variables(env: Mapping[str, str], known: Iterable[str]) -> list[str]:
    """One warning line per DFLASH_* variable of `env` that is no option's (`known`, the
    DFLASH_<OPTION> of every command) nor one of NOT_OPTIONS, naming the nearest known
    name: a misspelt variable is ignored, as it always was, but no longer silently. A
    warning, not a refusal: a shell may hold variables of another version or tool."""
    import difflib

    names = sorted({*known, *NOT_OPTIONS})
    lines = []
    for name in sorted(env):
        if not name.startswith("DFLASH_") or name in names:
            continue
        if name.startswith("DFLASH_REQUIRE_") or name.endswith("_BIN"):
            continue
        stems = {known_name.removeprefix("DFLASH_"): known_name for known_name in names}
        near = difflib.get_close_matches(name.removeprefix("DFLASH_"), stems, n=1, cutoff=0.6)
        hint = (
            f"did you mean {stems[near[0]]}?"
            if near
            else "`dflash-train COMMAND --help` lists them"
        )
        lines.append(f"warning: {name} is not a dflash-train variable and is ignored ({hint})")
    return lines


def echo_err(line: str) -> None:
    click.echo(line, err=True)


def write_json(json_path: str | None, figures: JSON, command: str = "eval") -> None:
    """Figures as JSON to `json_path` (`-`: standard output; None: nowhere), replaced
    atomically and recorded as `command`'s (dflash.files.write_output). When the file
    cannot be written after all (a full disk), the figures go to standard output before
    the one-line error: minutes of measuring are not lost."""
    text = json.dumps(figures, indent=2)
    if json_path == "-":
        click.echo(text)
    elif json_path:
        try:
            write_output(json_path, text + "\n", command)
        except OSError as exc:
            click.echo(text)
            raise InputError(
                f"--json: {write_failure(exc, json_path)}: the figures are on standard output"
            ) from None
