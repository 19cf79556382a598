"""A signal from the first millisecond of `dflash-train` on is one line and exit code
130/143: real processes, real signals (bench/signal_timing.py measures the whole table:
0.1 to 5 s after start, for train, eval and regenerate)."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash.cli.startup import exiting_at_once
from dflash.run.checkpoint import load_checkpoint, resolve_checkpoint
from tests.dflash.app_fixtures import ROOT, script_env, write_corpus

SMALL = "--batch-size 2 --seq-len 32 --drafter-layers 1 --block-size 4 --num-anchors 4"
SMALL_ARGS = [*SMALL.split(), "--eval-prompts", "0", "--steps", "100000"]


def popen(command: list[str]) -> subprocess.Popen:
    """`command` with its standard error read here (the command line's output)."""
    return subprocess.Popen(
        command, env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def stop_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "stopped by" in line]


def assert_one_stop_line(code: int, stderr: str, signum: int) -> str:
    assert code == 128 + signum, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    (line,) = stop_lines(stderr)
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert errors == [line], stderr
    assert line.startswith(f"Error: stopped by {signal.Signals(signum).name}"), line
    return line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "after_s"), [(signal.SIGTERM, 0.1), (signal.SIGINT, 0.8), (signal.SIGHUP, 0.5)]
)
def test_a_signal_in_the_first_second_of_train_is_one_line(
    tmp_path: Path, signum: int, after_s: float
) -> None:
    """0.1 s: the interpreter's start-up or the command line's imports; 0.8 s: the
    imports or torch's. Before, SIGINT there gave a KeyboardInterrupt traceback and
    SIGTERM ended the process without a word."""
    args = ["train", *SMALL_ARGS, "--data", str(write_corpus(tmp_path))]
    child = popen(
        [sys.executable, "-m", "dflash.cli", *args, "--output-dir", str(tmp_path / "run")]
    )
    time.sleep(after_s)
    child.send_signal(signum)
    _, err = child.communicate(timeout=300)
    assert_one_stop_line(child.returncode, err, signum)
    assert not (tmp_path / "run" / "config.json").exists()  # stopped before its start


_TRAINING = """
import sys
sys.path.insert(0, {root!r})
from tests.dflash.app_fixtures import small_target_everywhere
small_target_everywhere()
sys.argv = ["dflash-train", *{args!r}]
from dflash.cli import main
main()
"""


@pytest.mark.slow
def test_a_signal_in_the_training_loop_ends_with_the_line_naming_the_step(tmp_path) -> None:
    """After the checkpoint and the summary, the last line says where the run stopped."""
    run = tmp_path / "run"
    args = ["train", *SMALL_ARGS, "--log-every", "1", "--data", str(write_corpus(tmp_path))]
    code = textwrap.dedent(_TRAINING).format(root=str(ROOT), args=[*args, "--output-dir", str(run)])
    child = popen([sys.executable, "-c", code])
    assert child.stderr is not None
    seen = []
    for line in child.stderr:  # the first step is done: the loop is running
        seen.append(line)
        if line.startswith("step "):
            break
    child.send_signal(signal.SIGINT)
    _, rest = child.communicate(timeout=300)
    err = "".join(seen) + rest
    line = assert_one_stop_line(child.returncode, err, signal.SIGINT)
    assert line.startswith("Error: stopped by SIGINT during training at step "), line
    assert err.rstrip().endswith(line)  # the last line, after the summary
    assert list((run / "checkpoints").iterdir())  # the checkpoint of where it stopped


@pytest.mark.slow
def test_a_closed_terminal_loses_nothing(tmp_path: Path) -> None:
    """The run's terminal closes (its pty's master end), then SIGHUP arrives as from the
    shell that owned it: the step ends, the checkpoint and summary.json are written and
    the exit code is 129. Before, SIGHUP killed the process at once and nothing was saved;
    and every write to the dead terminal fails (EIO)."""
    run = tmp_path / "run"
    args = ["train", *SMALL_ARGS, "--log-every", "1", "--data", str(write_corpus(tmp_path))]
    code = textwrap.dedent(_TRAINING).format(root=str(ROOT), args=[*args, "--output-dir", str(run)])
    master, slave = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env=script_env(),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 300
    while b"\nstep " not in seen and time.monotonic() < deadline:  # training has begun
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                seen += os.read(master, 65536)
            except OSError:  # the child ended and closed the terminal
                break
    os.close(master)  # the terminal is gone: the child's writes fail from here on
    time.sleep(1.0)  # it goes on training, printing to nobody
    child.send_signal(signal.SIGHUP)
    assert child.wait(timeout=300) == 129, seen.decode(errors="replace")[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] == "SIGHUP" and summary["steps"] >= 1
    checkpoint = load_checkpoint(resolve_checkpoint("latest", run))
    assert checkpoint.step == summary["steps"]


_EXITING_AT_ONCE = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from dflash.cli.startup import exiting_at_once
from dflash.run.checkpoint import load_checkpoint, resolve_checkpoint
signal.signal(signal.SIGTERM, lambda *a: print("the command's handler", flush=True))
with exiting_at_once():  # as around torch's import
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
"""


def test_inside_exiting_at_once_a_signal_ends_the_process_with_one_line() -> None:
    code = textwrap.dedent(_EXITING_AT_ONCE).format(root=str(ROOT))
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == 143, child.stderr
    assert child.stderr == "Error: stopped by SIGTERM during start-up\n"
    assert child.stdout == "" and time.monotonic() - started < 4


def test_exiting_at_once_puts_the_commands_handlers_back() -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        with exiting_at_once():
            assert signal.getsignal(signal.SIGTERM) is not mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_importing_the_command_line_leaves_the_process_signals_alone() -> None:
    """Only `main` installs handlers: a program (or pytest) importing dflash.cli keeps its
    own Ctrl-C."""
    code = (
        "import signal, dflash.cli; "
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
        "signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, dflash.cli.cli.name)"
    )
    command = [sys.executable, "-c", code]

    def python_default_sigint() -> None:
        # A background job of a non-interactive shell (`cmd &`, CI under nohup) starts with
        # SIGINT ignored, and Python then keeps SIG_IGN: start from Python's own default.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    child = subprocess.run(
        command,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=python_default_sigint,
    )
    assert child.stdout.split() == ["True", "True", "cli"], child.stderr
