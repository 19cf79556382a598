"""A run owns its output folder: one run at a time, an earlier run kept unless --resume or
--overwrite, and a refused command leaves the folder as it found it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash import cli as cli_mod
from dflash.config.schema import ConfigError
from dflash.run.folder import LOCK_FILE, FolderLock, claim_output_dir, earlier_run
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    ROOT,
    script_env,
    small_cfg,
    small_options,
    tiny_target,
)


def invoke(args: list[str]):
    return CliRunner().invoke(cli_mod.cli, args, catch_exceptions=False)


def train_args(tmp_path: Path, output_dir: Path, **extra: object) -> list[str]:
    options = {**small_options(tmp_path, output_dir), **extra}
    args = ["train"]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        else:
            args += [flag, str(value)]
    return args


def folder_state(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the lock file aside) and a hash of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    return line


def test_a_held_folder_is_refused_naming_the_holder(tmp_path) -> None:
    cfg = small_cfg(tmp_path, tmp_path / "run")
    (tmp_path / "run").mkdir()
    with FolderLock(tmp_path / "run"):
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()} on "):
            claim_output_dir(cfg)
    claim_output_dir(cfg).release()  # free again once released


def test_a_folder_that_cannot_be_created_is_one_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot create or write it"):
        claim_output_dir(small_cfg(tmp_path, blocker / "run"))


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
def test_an_earlier_run_is_kept_unless_resumed_or_overwritten(tmp_path) -> None:
    run = tmp_path / "run"
    assert invoke(train_args(tmp_path, run, save_every=2)).exit_code == 0
    before = folder_state(run)
    assert {"config.json", "summary.json", "metrics.jsonl", "stats.json"} <= set(before)

    line = one_error_line(invoke(train_args(tmp_path, run, steps=4)))
    assert "holds an earlier run" in line and "--resume latest" in line and "--overwrite" in line
    # Refused at once, and by checks after the folder's: nothing in the folder changed.
    one_error_line(invoke(train_args(tmp_path, run, data=str(tmp_path / "missing.txt"))))
    one_error_line(invoke(train_args(tmp_path, run, resume="latest", block_size=8)))
    assert folder_state(run) == before

    result = invoke(train_args(tmp_path, run, steps=4, overwrite=True))
    assert result.exit_code == 0, result.output
    assert "--overwrite: removed the earlier run" in result.output
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 4
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["step-00000004"]  # the earlier run's are gone, not pruned later
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


_LONG_RUN = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.dflash.app_fixtures import small_cfg, small_target_everywhere
small_target_everywhere()
from dflash.run.pipelined import run_training
cfg = small_cfg(Path({tmp!r}), Path({out!r}), steps={steps}, log_every=1)
run_training(cfg, log=lambda line: None)
"""


def _run_in_child(tmp_path: Path, out: Path, steps: int) -> subprocess.Popen:
    code = textwrap.dedent(_LONG_RUN).format(
        root=str(ROOT), tmp=str(tmp_path), out=str(out), steps=steps
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _losses(folder: Path) -> list[tuple[int, float]]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [(json.loads(line)["step"], json.loads(line)["loss"]) for line in lines]


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
def test_a_second_run_into_a_running_folder_is_refused_and_the_first_is_unharmed(
    tmp_path,
) -> None:
    shared, lone = tmp_path / "shared", tmp_path / "lone"
    first = _run_in_child(tmp_path, shared, steps=40)
    deadline = time.monotonic() + 120
    while not (shared / "config.json").exists():  # written once its checks have passed
        assert first.poll() is None, first.stdout.read() if first.stdout else ""
        assert time.monotonic() < deadline, "the first run never started"
        time.sleep(0.05)
    started = time.monotonic()
    result = invoke(train_args(tmp_path, shared))
    refused_s = time.monotonic() - started
    line = one_error_line(result)
    assert f"in use by another run (pid {first.pid} on " in line and refused_s < 2.0
    assert first.wait(timeout=300) == 0, first.stdout.read() if first.stdout else ""
    alone = _run_in_child(tmp_path, lone, steps=40)
    assert alone.wait(timeout=300) == 0
    assert _losses(shared) == _losses(lone)  # the same figures as a run that was alone
    assert json.loads((shared / "summary.json").read_text())["steps"] == 40


_LIMITED_RUN = """
import resource, signal, sys
sys.path.insert(0, {root!r})
from tests.dflash.app_fixtures import small_target_everywhere
small_target_everywhere()
from dflash import cli
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
cli.cli({args!r})
"""


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
def test_a_final_save_that_cannot_be_written_keeps_the_last_complete_checkpoint(tmp_path) -> None:
    """A file-size limit makes the final checkpoint's write fail as a full disk does: one
    line naming the path and the space left, exit 2, the earlier checkpoint and drafter
    intact."""
    run = tmp_path / "run"
    assert invoke(train_args(tmp_path, run, save_every=2)).exit_code == 0
    complete = run / "checkpoints" / "step-00000006"
    kept = {
        **folder_state(complete),
        **{f"drafter/{k}": v for k, v in folder_state(run / "drafter").items()},
    }
    limit = (complete / "trainer.pt").stat().st_size // 2
    args = train_args(tmp_path, run, steps=8, resume="latest")[1:]
    code = textwrap.dedent(_LIMITED_RUN).format(root=str(ROOT), limit=limit, args=["train", *args])
    command = [sys.executable, "-c", code]
    child = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=300)
    assert child.returncode == 2, child.stdout + child.stderr
    errors = [line for line in child.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in child.stderr, child.stderr
    assert "step-00000008" in errors[0] and "GiB free there" in errors[0]
    assert f"the last complete checkpoint is {complete}" in errors[0]
    assert not list((run / "checkpoints").glob(".tmp-*"))  # its space given back
    after = {
        **folder_state(complete),
        **{f"drafter/{k}": v for k, v in folder_state(run / "drafter").items()},
    }
    assert after == kept


@pytest.mark.slow
def test_a_checkpoint_during_training_that_cannot_be_written_is_the_same_one_line(
    tmp_path,
) -> None:
    """A full disk at a mid-run checkpoint (written by the drafter thread) ends as the
    final save's does: one line naming the path and the space left, exit 2, not a
    stage failure with exit 1."""
    run = tmp_path / "run"
    args = train_args(tmp_path, run, save_every=2)[1:]
    limit = 100_000  # config.json and metrics.jsonl fit, a checkpoint's trainer.pt does not
    code = textwrap.dedent(_LIMITED_RUN).format(root=str(ROOT), limit=limit, args=["train", *args])
    command = [sys.executable, "-c", code]
    child = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=300)
    assert child.returncode == 2, child.stdout + child.stderr
    errors = [line for line in child.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in child.stderr, child.stderr
    assert f"could not write {run / 'checkpoints' / 'step-00000002'} (" in errors[0]
    assert "GiB free there" in errors[0] and "no checkpoint of this run is complete" in errors[0]
    assert not list((run / "checkpoints").glob(".tmp-*"))  # its space given back


_SIGNALLED_RUN = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from tests.dflash.app_fixtures import small_target_everywhere
small_target_everywhere()
import importlib
module_name, name = {function!r}.rsplit(".", 1)
module = importlib.import_module(module_name)
real = getattr(module, name)

def signalled(*args, **kwargs):  # the signal arrives while the main thread is in there
    os.kill(os.getpid(), signal.{signal_name})
    time.sleep(5)
    return real(*args, **kwargs)

setattr(module, name, signalled)
from dflash import cli
cli.cli({args!r}, prog_name="dflash-train")
"""


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
@pytest.mark.parametrize(
    ("function", "signal_name", "code", "phase"),
    [
        ("dflash.run.build.training_rows", "SIGTERM", 143, "data.prepare"),
        ("dflash.run.build.training_rows", "SIGINT", 130, "data.prepare"),
        ("dflash.run.build.build_drafter", "SIGTERM", 143, "drafter.build"),
        ("dflash.run.finish.evaluate_run", "SIGTERM", 143, "eval"),
    ],
)
def test_a_signal_outside_the_training_loop_is_one_line_and_keeps_what_is_known(
    tmp_path, function, signal_name, code, phase
) -> None:
    run = tmp_path / "run"
    args = ["train", *train_args(tmp_path, run)[1:]]
    source = textwrap.dedent(_SIGNALLED_RUN).format(
        root=str(ROOT), function=function, signal_name=signal_name, args=args
    )
    started = time.monotonic()
    command = [sys.executable, "-c", source]
    child = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=300)
    assert child.returncode == code, child.stderr
    assert time.monotonic() - started < 60
    errors = [line for line in child.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: stopped by {signal_name} during {phase}"], child.stderr
    assert "Traceback" not in child.stderr and "Aborted!" not in child.stderr
    if phase != "eval":  # in the start-up: its table, and its stats alone in the new folder
        assert "interval: total" in child.stderr and phase in child.stderr
        assert set(folder_state(run)) == {"stats.json", "timeline.json"}
        stats = json.loads((run / "stats.json").read_text())["phases"]
        assert stats["target.load"]["count"] == 1 and stats[phase]["count"] >= 1
        assert earlier_run(run) == []  # no earlier run: the next one is not refused
        return
    summary = json.loads((run / "summary.json").read_text())  # valid JSON: null, not NaN
    assert summary["interrupted"] == f"stopped by {signal_name} during eval"
    assert summary["tau"] is None and summary["steps"] == 6
    assert summary["drafter_dir"] == str(run / "drafter")
    assert (run / "stats.json").is_file() and (run / "report.html").is_file()


@pytest.mark.usefixtures("tiny_target")
@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"drafter_layers": 100000}, "GiB on cpu, more than its"),
        ({"seq_len": 1000000}, "--allow-over-memory"),
        ({"seq_len": 100000000000}, "--allow-over-memory"),
    ],
)
def test_a_run_too_big_for_the_machine_is_refused_before_any_work(tmp_path, extra, fragment):
    run = tmp_path / "new" / "run"
    started = time.monotonic()
    line = one_error_line(invoke(train_args(tmp_path, run, **extra)))
    assert fragment in line and time.monotonic() - started < 10
    assert not run.exists()  # the folder it made for the run is gone again


def test_a_target_position_limit_is_checked_before_loading(tmp_path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    # A config.json and no weights: a load would fail, the check comes first.
    config = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2}
    config |= {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    config |= {"vocab_size": 1000, "max_position_embeddings": 256}
    (target / "config.json").write_text(json.dumps(config))
    args = train_args(tmp_path, tmp_path / "run", target=str(target), seq_len=512)
    line = one_error_line(invoke(args))
    assert "--seq-len 512" in line and "max_position_embeddings 256" in line


@pytest.mark.usefixtures("tiny_target")
def test_data_that_cannot_train_stops_before_step_one(tmp_path) -> None:
    chats = tmp_path / "chats.jsonl"
    long_reply = "a reply far longer than one row of the run " * 4
    with chats.open("w") as out:
        for i in range(20):
            question = {"role": "user", "content": f"question {i}"}
            messages = [question, {"role": "assistant", "content": long_reply}]
            out.write(json.dumps({"messages": messages}) + "\n")
    run = tmp_path / "run"
    line = one_error_line(invoke(train_args(tmp_path, run, data=str(chats), seq_len=32)))
    assert re.search(r"--seq-len 32 drops (\d+) of \1 conversations", line), line
    assert "--max-dropped-share" in line and not run.exists()
