"""How a config field is declared, checked and shown: the machinery of dflash.config.

A field is declared with `setting(default, help, **range)`; `field_options(cls)`
reads its type from the annotation (`Literal` for choices, `| None` when unset is
allowed, `tuple[T, ...]` for lists) and gives the `Option` that the CLI, the
environment, config files and validation all use. A `Schema` is the named sections of
one command (the training run's, `eval`'s, ...): its option names, and what a config
file's mapping sets.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash.errors import DFlashError

# Any: a setting's value; its type is the field's own (int, float, bool, str, a Literal's
# str, a tuple), known from the field's hint at run time only.
Value = Any
# Any: a value of a parsed config file (JSON or TOML), any of their types until checked.
Json = Any


class ConfigError(DFlashError):
    """A setting has a bad value; the message is one line naming the flag."""


@dataclass(frozen=True)
class Spec:
    """How one field is checked and shown; see `setting`."""

    help: str
    option: str | None = None
    min: float | None = None
    max: float | None = None
    gt: float | None = None
    lt: float | None = None
    check: Callable[[Value], str | None] | None = None
    invocation: bool = False
    repeatable: bool = False  # a list the command line also takes as a repeated flag


def setting(default: Value, help: str, *, option: str | None = None, **spec: Any) -> Any:
    """A config field: its default, one help line (units, meaning) and its range.

    `option` is the flat option name when it differs from the field name; `min`/`max`
    are inclusive bounds, `gt`/`lt` exclusive ones, `check(value)` returns the reason a
    value is bad (or None). `invocation=True` marks a flag of one invocation
    (`--overwrite`, `--debug`): it is not saved with a run and never read from a config
    file, where the flag of the run that wrote the file would act again unasked. A
    default of None on a type without `| None` makes the option required. A list with
    `repeatable=True` is also taken as a repeated flag (`--report-to a --report-to b`).
    """
    # Any: **spec is Spec's keywords, forwarded; the answer is a dataclasses.field, which
    # stands for the field's declared type.
    return field(default=default, metadata={"dflash": Spec(help, option, **spec)})


@dataclass(frozen=True)
class Option:
    """One setting as the CLI, the environment and config files see it."""

    name: str  # flat option name, snake_case
    section: str
    field: str
    kind: type  # int, float, bool, str or tuple
    item: type | None  # element type of a tuple
    choices: tuple[str, ...] | None
    optional: bool  # None (unset) is allowed
    default: Value
    spec: Spec

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def envvar(self) -> str:
        return "DFLASH_" + self.name.upper()

    @property
    def required(self) -> bool:
        return self.default is None and not self.optional

    def fail(self, value: object, reason: str, origin: str | None = None) -> ConfigError:
        """The one line of a bad value; `origin` names where it came from when that was
        not the flag (an environment variable, a config file's key)."""
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
        where = f" (from {origin})" if origin else ""
        return ConfigError(f"{self.flag} {shown!r}{where} is invalid: {reason}")

    def validate(self, value: Value, origin: str | None = None) -> None:
        """Type, finiteness, range, choices and the field's own check; ConfigError."""
        if value is None:
            if not self.optional:
                raise self.fail(value, "must be set", origin)
            return
        reason = self._type_reason(value) or self._range_reason(value)
        if reason is None and self.spec.check is not None:
            reason = self.spec.check(value)
        if reason is not None:
            raise self.fail(value, reason, origin)

    def _type_reason(self, value: Value) -> str | None:
        if self.kind is tuple:
            ok = isinstance(value, tuple) and all(_is(v, self.item) for v in value)
            return None if ok else f"expected a list of {_kind_name(self.item)}"
        if not _is(value, self.kind):
            return f"expected {_kind_name(self.kind)}"
        if self.kind is float and not math.isfinite(value):
            return "must be a finite number"
        if self.choices is not None and value not in self.choices:
            return f"expected one of {', '.join(self.choices)}"
        return None

    def _range_reason(self, value: Value) -> str | None:
        s = self.spec
        if s.min is not None and value < s.min:
            return f"must be at least {s.min:g}"
        if s.max is not None and value > s.max:
            return f"must be at most {s.max:g}"
        if s.gt is not None and not value > s.gt:
            return f"must be > {s.gt:g}"
        if s.lt is not None and not value < s.lt:
            return f"must be < {s.lt:g}"
        return None

    def from_file(self, value: Json, source: str) -> Value:
        """A value as a config file holds it -> the field's value (strictly typed)."""
        if value is None and self.optional:
            return None
        if self.kind is tuple:
            parts = value.split(",") if isinstance(value, str) else value
            if isinstance(parts, list):
                converted = [_item_from_file(p, self.item) for p in parts]
                if all(c is not None for c in converted):
                    return tuple(converted)
        elif _is(value, self.kind):
            return float(value) if self.kind is float else value
        want = f"list of {_kind_name(self.item)}" if self.kind is tuple else _kind_name(self.kind)
        raise ConfigError(f"{source}: key {self.name!r}: expected {want}, got {value!r}")


def _item_from_file(part: Json, item: type | None) -> Value:
    """One list element of a file value (comma-separated text gives strings)."""
    if isinstance(part, str):
        part = part.strip()
        if item is int:
            return int(part) if re.fullmatch(r"-?\d+", part) else None
    return part if _is(part, item) else None


def _is(value: object, kind: type | None) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) if kind is not None else False


def _kind_name(kind: type | None) -> str:
    names = {int: "integer", float: "number", bool: "boolean", str: "text"}
    return names.get(kind, "value") if kind is not None else "value"


def _option(f: dataclasses.Field[Value], hint: Any) -> Option:  # hint: a typing form
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    choices, item = None, None
    kind: Any  # a type, or Literal's str
    origin = typing.get_origin(hint)
    if origin is Literal:
        kind, choices = str, tuple(typing.get_args(hint))
    elif origin is tuple:
        kind, item = tuple, typing.get_args(hint)[0]
    else:
        kind = hint
    spec: Spec = f.metadata["dflash"]
    name = spec.option or f.name
    return Option(name, "", f.name, kind, item, choices, optional, f.default, spec)


_FIELD_OPTIONS: dict[type, tuple[Option, ...]] = {}  # by section class; a race recomputes


def field_options(cls: type) -> tuple[Option, ...]:
    """The options of a section dataclass, in declaration order (section left empty).

    Fields not declared with `setting` are no options: values a command hands over from
    options declared elsewhere (`eval`'s prompts come from the run's `--data`)."""
    found = _FIELD_OPTIONS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        found = tuple(_option(f, hints[f.name]) for f in fields if "dflash" in f.metadata)
        _FIELD_OPTIONS[cls] = found
    return found


class Section:
    """Base of the config sections: checks every field against its declaration."""

    def __post_init__(self) -> None:
        for opt in field_options(type(self)):
            opt.validate(getattr(self, opt.field))


@dataclass(frozen=True)
class FileValues:
    """What a config file sets: option values, the key that set each (as written), and
    the invocation flags it held, left out (see `setting`)."""

    values: dict[str, Value] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    left_out: tuple[str, ...] = ()


def _key_name(key: object) -> str:
    return str(key).replace("-", "_")


class Schema:
    """The named sections of one command: its options by flat name, and what a config
    file's mapping (flat names in snake or kebab case, or `section: {field: ...}`) sets."""

    def __init__(self, sections: Mapping[str, type[Section]]) -> None:
        self.sections = dict(sections)
        self.options = tuple(
            dataclasses.replace(opt, section=name)
            for name, cls in self.sections.items()
            for opt in field_options(cls)
        )
        self.by_name: dict[str, Option] = {}
        for opt in self.options:
            assert opt.name not in self.by_name, f"option name {opt.name} is declared twice"
            self.by_name[opt.name] = opt

    def section_options(self, section: str) -> tuple[Option, ...]:
        return tuple(opt for opt in self.options if opt.section == section)

    def holds(self, key: object, value: Json) -> bool:
        """Whether a top-level key of a config file is one of these sections (a mapping)
        or options (anything else): `drafter: {...}` of a run's config.json is its section,
        not `eval --drafter`."""
        name = _key_name(key)
        return name in self.sections if isinstance(value, Mapping) else name in self.by_name

    def _items(self, raw: Mapping[str, Json], source: str) -> Iterator[tuple[str, Option, Json]]:
        """(key as written, option, value) of a flat or sectioned mapping."""
        for key, value in raw.items():
            name = _key_name(key)
            if name in self.sections and isinstance(value, Mapping):
                by_field = {o.field: o for o in self.section_options(name)}
                for sub, item in value.items():
                    opt = by_field.get(_key_name(sub))
                    if opt is None:
                        raise ConfigError(
                            f"{source}: unknown key {name}.{sub!s} in section {name!r}"
                        )
                    yield f"{name}.{sub}", opt, item
            elif name in self.by_name:
                yield str(key), self.by_name[name], value
            else:
                what = "section" if isinstance(value, Mapping) else "key"
                raise ConfigError(f"{source}: unknown {what} {key!s}")

    def read(self, raw: Mapping[str, Json], source: str) -> FileValues:
        """The values of a config file's mapping; an unknown section or key, a wrong type
        or an option set twice is one ConfigError naming the key and `source`."""
        keys: dict[str, str] = {}  # option -> the key that set it
        for key, opt, _ in self._items(raw, source):
            if opt.name in keys:  # flat and in its section, or snake and kebab case
                raise ConfigError(
                    f"{source}: {opt.flag} is set twice, as {keys[opt.name]!r} and as {key!r}: "
                    "keep one"
                )
            keys[opt.name] = key
        values = {
            opt.name: opt.from_file(value, source)
            for _, opt, value in self._items(raw, source)
            if not opt.spec.invocation
        }
        left_out = tuple(name for name in keys if self.by_name[name].spec.invocation)
        kept = {name: key for name, key in keys.items() if name in values}
        return FileValues(values, kept, left_out)

    def build(self, values: Mapping[str, Value]) -> dict[str, Section]:
        """Every section, validated, with `values` (flat option names) over its defaults."""
        fields: dict[str, dict[str, Value]] = {name: {} for name in self.sections}
        for name, value in values.items():
            opt = self.by_name[name]
            fields[opt.section][opt.field] = tuple(value) if isinstance(value, list) else value
        return {name: cls(**fields[name]) for name, cls in self.sections.items()}
