"""Whose file an output path is, whether it can be written (found by doing), and one
writer per output: on real folders, links, /proc and locks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash.config.schema import ConfigError
from dflash.run.folder import LOCK_FILE, FolderLock
from dflash.run.outputs import (
    Output,
    OutputError,
    check_outputs,
    check_run_folder,
    check_run_outputs,
    output_problem,
    write_problem,
)
from tests.dflash.app_fixtures import small_cfg


def make_run(folder: Path) -> Path:
    """A finished run's folder as training leaves it (the files that mark it)."""
    (folder / "checkpoints" / "step-00000004" / "drafter").mkdir(parents=True)
    (folder / "drafter").mkdir()
    (folder / "drafter" / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    (folder / "config.json").write_text(json.dumps({"schema_version": 3, "run": {}}))
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "summary.json").write_text('{"steps": 4}\n')
    (folder / LOCK_FILE).write_text("")
    return folder


# --------------------------------------------------------------------------- writability


@pytest.mark.skipif(os.geteuid() != 0, reason="as root, permission bits say yes to /proc")
def test_as_root_proc_and_sys_are_found_unwritable_by_trying() -> None:
    assert os.access("/proc", os.W_OK)  # what asking says
    assert "/proc takes no new files" in write_problem("/proc/figures.json")
    assert "/proc takes no new files" in write_problem("/proc/run", folder=True)
    assert "/sys takes no new files" in write_problem("/sys/figures.json")


def test_a_probe_leaves_the_folder_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "kept.txt").write_text("x")
    assert write_problem(tmp_path / "new" / "deeper" / "out.json") is None
    assert write_problem(tmp_path / "out", folder=True) is None
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def test_a_name_over_255_bytes_is_one_reason_not_a_crash(tmp_path: Path) -> None:
    long = "é" * 130  # 260 bytes in UTF-8, 130 characters
    why = write_problem(tmp_path / long / "out.json")
    assert why == "a path component is 260 bytes long, more than the 255 a name may have"
    assert "longer" not in (write_problem(tmp_path / ("a" * 255)) or "")  # 255 is allowed


def test_files_and_folders_in_the_way(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert write_problem(blocker / "out.json") == f"{blocker} is a file, not a folder"
    assert write_problem(blocker, folder=True) == "it is a file, not a folder"
    assert write_problem(tmp_path) == "it is a folder"


# --------------------------------------------------------------------------- whose path


def test_an_output_that_is_an_input_or_inside_one_names_both(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    drafter = str(run / "drafter")
    config = str(run / "drafter" / "config.json")
    why = output_problem(Output("--json", config), [("--drafter", drafter)])
    assert why == (
        f"--json {config!r} is inside --drafter {drafter!r}: an output never writes into an input"
    )
    data = tmp_path / "corpus.txt"
    data.write_text("text")
    (tmp_path / "link.txt").symlink_to(data)
    os.link(data, tmp_path / "hard.txt")
    for name in ("corpus.txt", "link.txt", "hard.txt"):
        why = output_problem(Output("--output", str(tmp_path / name)), [("--data", str(data))])
        assert why is not None and f"is --data {str(data)!r}" in why, name
    hub_id = [("--target", "Qwen/Qwen3-8B")]  # no such path here: nothing to clash with
    assert output_problem(Output("--output", str(tmp_path / "r.jsonl")), hub_id) is None


def test_the_files_of_another_run_are_refused_a_new_file_beside_them_is_not(tmp_path) -> None:
    run = make_run(tmp_path / "run")
    owned = [
        ("metrics.jsonl", "metrics.jsonl"),
        ("timeline.json", "timeline.json"),
        ("checkpoints/step-00000004/x", "checkpoints/"),
        ("drafter/config.json", "drafter/"),
    ]
    for name, shown in owned:
        why = output_problem(Output("--trace-file", str(run / name)))
        assert why == (
            f"--trace-file {str(run / name)!r} is {shown} of the run in {str(run)!r}: "
            "choose a path outside that run's files"
        )
    assert output_problem(Output("--json", str(run / "eval.json"))) is None
    folder = output_problem(Output("--output", str(run), folder=True))
    assert folder is not None and "holds a training run (config.json, summary.json" in folder


def test_the_runs_own_files_are_refused_but_the_one_the_option_writes(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    own = output_problem(Output("--trace-file", str(run / "metrics.jsonl")), own_run=run)
    assert own is not None and "is metrics.jsonl of this run's --output-dir" in own
    timeline = Output("--timeline", str(run / "timeline.json"), own_name="timeline.json")
    assert output_problem(timeline, own_run=run) is None  # its own default place
    assert output_problem(Output("--trace-file", str(run / "trace.jsonl")), own_run=run) is None


def test_a_run_folder_inside_another_run_is_refused_by_link_or_real_path(tmp_path) -> None:
    run = make_run(tmp_path / "run")
    (tmp_path / "link").symlink_to(run / "checkpoints")
    for inside in (run / "checkpoints" / "new", tmp_path / "link" / "new", run / "sub"):
        with pytest.raises(OutputError, match=rf"is inside the run in '{run}'"):
            check_run_folder(small_cfg(tmp_path, inside))
    check_run_folder(small_cfg(tmp_path, run))  # its own folder: --resume decides
    check_run_folder(small_cfg(tmp_path, tmp_path / "elsewhere"))


def test_a_run_folder_that_is_an_input_is_refused(tmp_path: Path) -> None:
    drafter = tmp_path / "old-drafter"
    drafter.mkdir()
    with pytest.raises(OutputError, match="is --init-from"):
        check_run_folder(small_cfg(tmp_path, drafter, init_from=str(drafter)))


def test_two_outputs_of_one_command_are_never_one_path(tmp_path: Path) -> None:
    same = str(tmp_path / "x.json")
    cfg = small_cfg(tmp_path, tmp_path / "run", trace_file=same, timeline=same)
    with pytest.raises(OutputError, match="--trace-file .* and --timeline .* are one path"):
        check_run_outputs(cfg)
    with pytest.raises(OutputError, match="are one path"):
        check_outputs([Output("--a", str(tmp_path / "o")), Output("--b", str(tmp_path / "o"))])


# --------------------------------------------------------------------------- one writer


def test_one_writer_per_output_the_second_named_the_first(tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper" / "regen.jsonl"
    first = FolderLock.for_output(out, "--output")
    first.acquire()
    lock_file = out.parent / ".regen.jsonl.dflash-lock"
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    with pytest.raises(ConfigError) as refused:
        FolderLock.for_output(out, "--output").acquire()
    assert str(refused.value).startswith(
        f"--output {str(out)!r} is being written by another process (pid {os.getpid()} on "
    )
    first.release()
    assert not (tmp_path / "new").exists()  # the folders made for the lock, gone again
    again = FolderLock.for_output(out, "--output")
    again.acquire()
    out.write_text("a line\n")
    again.release()
    assert [p.name for p in out.parent.iterdir()] == ["regen.jsonl"]  # no lock file left


_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from dflash.run.folder import FolderLock
FolderLock.for_output({out!r}, "--output").acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_writer_that_dies_frees_its_output_at_once(tmp_path: Path) -> None:
    """flock: the kernel drops the lock with the process, however it ends."""
    root = str(Path(__file__).resolve().parents[3])
    out = str(tmp_path / "regen.jsonl")
    code = textwrap.dedent(_HOLDER).format(root=root, out=out)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on "):
            FolderLock.for_output(out, "--output").acquire()
    finally:
        holder.kill()
        holder.wait()
    started = time.monotonic()
    lock = FolderLock.for_output(out, "--output")
    lock.acquire()
    lock.release()
    assert time.monotonic() - started < 1.0
