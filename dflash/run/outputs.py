"""Whose file an output path is, and whether it can be written.

Every path a command writes is checked before any work, so that a command never writes
over what it reads or what a run owns:
- it can be written, found by doing: a file is created and removed in the nearest
  existing folder (as root, permission bits and `os.access` say yes to /proc and /sys);
- it is none of the command's inputs, nor inside an input folder (`eval --json
  RUN/drafter/config.json` would replace the config of the drafter it reads);
- it is none of the files a run writes into its folder (config.json, metrics.jsonl,
  checkpoints/, drafter/, ...), of another run or of the run this command is (a
  `--trace-file` onto the run's own metrics.jsonl); a run's folder is never inside
  another run's folder;
- two outputs of one command are not one path;
- a file that exists is replaced only when this command wrote it (its record,
  dflash.files.record_path, says so) or --overwrite is given: `eval --json` never
  replaces a JSON the user wrote.
Paths are compared as they resolve (symbolic links followed, hard links by inode).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash.config.settings import TrainConfig
from dflash.errors import DFlashError
from dflash.files import record_path, special_file, written_by
from dflash.run.folder import LOCK_FILE, METRICS_FILE, RUN_DIRS, RUN_FILES, earlier_run

NAME_MAX_BYTES = 255  # where the file system does not say (os.pathconf)
# Files a run writes besides RUN_FILES and RUN_DIRS: one per rank, and its temporary names.
_RUN_NAME_PREFIXES = ("timeline.json.", "pipeline-error-", ".tmp-")


class OutputError(DFlashError):
    """An output path that cannot or must not be written; one line naming it (and the
    path it clashes with)."""


@dataclass(frozen=True)
class Output:
    """A path a command writes: `flag` names it in messages; `folder`: the command writes
    into it; `own_name`: the file of the run's own folder this option writes anyway (its
    default, e.g. timeline.json for --timeline); `command`: an existing regular file is
    replaced only when this command wrote it (its record) or with `overwrite`."""

    flag: str
    path: str
    folder: bool = False
    own_name: str | None = None
    command: str | None = None
    overwrite: bool = False


# --------------------------------------------------------------------------- writability


def write_problem(path: Path | str, folder: bool = False) -> str | None:
    """Why `path` could not be written as a file (`folder`: as a folder to write into),
    found by creating and removing a file in the nearest existing folder; None when it
    can be. The parents a write would create need a writable existing ancestor."""
    target = Path(path).expanduser()
    try:
        too_long = _long_component(target)
        if too_long is not None:
            return too_long
        return _write_problem(target, folder)
    except OSError as exc:  # a name the kernel refuses, a loop of links, ...
        return exc.strerror or type(exc).__name__


def _long_component(target: Path) -> str | None:
    limit = _name_max(_nearest_existing(target))
    for part in target.parts:
        size = len(os.fsencode(part))
        if size > limit:
            return f"a path component is {size} bytes long, more than the {limit} a name may have"
    return None


def _name_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX_BYTES


def _nearest_existing(target: Path) -> Path:
    probe = target
    while not _exists(probe) and probe != probe.parent:
        probe = probe.parent
    return probe


def _exists(path: Path) -> bool:
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:  # a file on the way, or a name too long: nothing is there
        if exc.errno in (errno.ENOTDIR, errno.ENAMETOOLONG):
            return False
        raise
    return True


def _write_problem(target: Path, folder: bool) -> str | None:
    if _exists(target):
        if folder and not target.is_dir():
            return "it is a file, not a folder"
        if not folder and target.is_dir():
            return "it is a folder"
        if not folder:
            try:  # opened for appending: nothing of it changes
                os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
            except OSError as exc:
                return f"it cannot be opened for writing ({exc.strerror})"
    where = _nearest_existing(target if folder else target.parent)
    if not where.is_dir():
        return f"{where} is a file, not a folder"
    why = _probe(where)
    return None if why is None else f"{where} takes no new files ({why})"


def _probe(folder: Path) -> str | None:
    """None when a file can be created (and is removed again) in `folder`."""
    probe = folder / f".dflash-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    with contextlib.suppress(OSError):
        probe.unlink()
    return None


# --------------------------------------------------------------------------- whose path


def resolved(path: Path | str) -> Path:
    """The absolute path `path` names once links are followed (missing parts kept)."""
    try:
        return Path(os.path.realpath(Path(path).expanduser()))
    except (OSError, ValueError):
        return Path(os.path.abspath(Path(path).expanduser()))


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def _inside(path: Path, folder: Path) -> bool:
    return path != folder and path.is_relative_to(folder)


def is_run_folder(folder: Path) -> bool:
    """A folder a training run writes: its lock, metrics or summary, or its config.json."""
    if any((folder / name).is_file() for name in (LOCK_FILE, METRICS_FILE, "summary.json")):
        return True
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "schema_version" in config and "run" in config


def _owned_name(name: str) -> bool:
    owned = name in RUN_FILES or name in RUN_DIRS or name == LOCK_FILE
    return owned or name.startswith(_RUN_NAME_PREFIXES)


def run_folders_above(path: Path) -> list[Path]:
    """The run folders that hold `path` (resolved), outermost first; `path` itself too."""
    found = [folder for folder in (path, *path.parents) if _exists(folder) and folder.is_dir()]
    return [folder for folder in reversed(found) if is_run_folder(folder)]


def owning_run(path: Path) -> tuple[Path, str] | None:
    """(run folder, its entry) when `path` (resolved) is, or is inside, a file or folder
    that a run writes into its folder; the outermost such run."""
    for folder in run_folders_above(path):
        if path == folder:
            continue
        entry = path.relative_to(folder).parts[0]
        if _owned_name(entry):
            return folder, entry
    return None


def input_clash(output: Output, inputs: Iterable[tuple[str, str | None]]) -> str | None:
    """The line refusing `output` when it is one of `inputs` ((flag, path) pairs; a value
    that is no existing path, such as a hub id, is no file here) or lies inside one."""
    out = resolved(output.path)
    for flag, value in inputs:
        if value is None or not _exists(Path(value).expanduser()):
            continue
        source = resolved(value)
        if _same(out, source):
            return (
                f"{output.flag} {output.path!r} is {flag} {value!r}: an output never replaces "
                "an input"
            )
        if source.is_dir() and _inside(out, source):
            return (
                f"{output.flag} {output.path!r} is inside {flag} {value!r}: an output never "
                "writes into an input"
            )
    return None


def run_clash(output: Output, own_run: Path | str | None = None) -> str | None:
    """The line refusing `output` when a run owns it: a file or folder a run writes (of
    `own_run`, this command's own run, only those this option does not write itself), or
    for a folder output, another run's whole folder."""
    out = resolved(output.path)
    own = resolved(own_run) if own_run is not None else None
    if own is not None and _inside(out, own):
        entry = out.relative_to(own).parts[0]
        if _owned_name(entry) and entry != output.own_name:
            return (
                f"{output.flag} {output.path!r} is {entry} of this run's --output-dir "
                f"{str(own_run)!r}: the run writes it itself; choose another path"
            )
    owner = owning_run(out)
    if owner is not None and (own is None or owner[0] != own):
        folder, entry = owner
        what = f"{entry}/" if entry in RUN_DIRS else entry
        return (
            f"{output.flag} {output.path!r} is {what} of the run in {str(folder)!r}: "
            "choose a path outside that run's files"
        )
    if output.folder and out != own and _exists(out) and is_run_folder(out):
        held = ", ".join(earlier_run(out)) or LOCK_FILE
        return f"{output.flag} {output.path!r} holds a training run ({held}): choose another folder"
    return None


def output_problem(
    output: Output,
    inputs: Iterable[tuple[str, str | None]] = (),
    own_run: Path | str | None = None,
) -> str | None:
    """The one line refusing `output`, or None: writability, then inputs, then runs."""
    why = write_problem(output.path, folder=output.folder)
    if why is not None:
        return f"{output.flag} {output.path!r} cannot be written: {why}"
    clash = input_clash(output, list(inputs)) or run_clash(output, own_run)
    return clash or replace_problem(output)


def replace_problem(output: Output) -> str | None:
    """The line refusing to replace an existing file that `output.command` did not write
    (no record of it, or the file changed since), unless `output.overwrite`."""
    if output.command is None or output.overwrite:
        return None
    path = Path(output.path).expanduser()
    if not path.is_file() or special_file(path) is not None or written_by(path, output.command):
        return None
    return (
        f"{output.flag} {output.path!r} exists and was not written by dflash-train "
        f"{output.command} (no record of it in {record_path(path).name}, or changed since): "
        "--overwrite replaces it, or choose another path"
    )


def check_outputs(
    outputs: Sequence[Output],
    inputs: Iterable[tuple[str, str | None]] = (),
    own_run: Path | str | None = None,
) -> None:
    """Raises OutputError for the first output that is refused, or two that are one."""
    inputs = list(inputs)
    for output in outputs:
        why = output_problem(output, inputs, own_run)
        if why is not None:
            raise OutputError(why)
    for i, first in enumerate(outputs):
        for second in outputs[i + 1 :]:
            if _same(resolved(first.path), resolved(second.path)):
                raise OutputError(
                    f"{first.flag} {first.path!r} and {second.flag} {second.path!r} are one "
                    "path: each output needs its own"
                )


# --------------------------------------------------------------------------- a run's paths


def run_inputs(cfg: TrainConfig, config_file: str | None = None) -> list[tuple[str, str | None]]:
    """What a training run of `cfg` reads from files (a value that is no path is skipped
    where it is compared). --resume is not among them: it names the run's own folder or
    checkpoints, which the run folder's own checks cover."""
    return [
        ("--config", config_file),
        ("--data", cfg.data.source),
        ("--target", cfg.target.spec),
        ("--hidden-cache", cfg.data.hidden_cache),
        ("--init-from", cfg.run.init_from),
    ]


def run_outputs(cfg: TrainConfig) -> list[Output]:
    """The files a run writes besides its own folder's."""
    outputs = []
    if cfg.telemetry.trace_file is not None:
        outputs.append(Output("--trace-file", cfg.telemetry.trace_file))
    if cfg.telemetry.timeline not in (None, "off"):
        outputs.append(Output("--timeline", str(cfg.telemetry.timeline), own_name="timeline.json"))
    return outputs


def check_run_folder(cfg: TrainConfig, config_file: str | None = None) -> None:
    """--output-dir is no input, no input's content and inside no other run's folder (by
    real path: a link into another run's checkpoints/ is inside it)."""
    out = resolved(cfg.run.output_dir)
    output = Output("--output-dir", cfg.run.output_dir, folder=True)
    why = input_clash(output, run_inputs(cfg, config_file))
    if why is not None:
        raise OutputError(why)
    outer = [folder for folder in run_folders_above(out) if folder != out]
    if outer:
        raise OutputError(
            f"--output-dir {cfg.run.output_dir!r} is inside the run in {str(outer[0])!r}: "
            "a run's folder never holds another run; choose a folder outside it"
        )


def check_run_outputs(cfg: TrainConfig, config_file: str | None = None) -> None:
    """Every path a run of `cfg` writes, checked before any work (see the module)."""
    check_run_folder(cfg, config_file)
    check_outputs(run_outputs(cfg), run_inputs(cfg, config_file), own_run=cfg.run.output_dir)
