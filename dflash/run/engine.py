"""A serving engine started for one measurement: `train --eval-engine vllm`.

The run's saved drafter is served beside its target by vLLM's OpenAI server on loopback
(`--vllm-command`, given the target, the drafter and a port), τ is measured through the
engine's own counters as `eval --server` measures it, and the engine is stopped. The
server runs in a process group of its own so that its engine-core and worker processes
(gigabytes each) end with it, whatever ends the run. Its output goes to
OUTPUT_DIR/vllm.log, the place to look when it does not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from dflash.errors import DFlashError
from dflash.eval.served import evaluate_served, format_served
from dflash.log import Log, say
from dflash.summary import ServedFigures
from dflash.target.served import CompletionClient, ServerSettings, TokenizerTarget

START_TIMEOUT_S = 900.0  # a large target loads for minutes
STOP_TIMEOUT_S = 30.0
LOG_NAME = "vllm.log"


class EngineError(DFlashError):
    """The engine did not start or serve; one line naming the command and its log."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_vllm_command(command: str) -> None:
    """One line before any work when the command cannot be run at all."""
    try:
        program = shlex.split(command)[0]
    except (ValueError, IndexError):
        raise EngineError(f"--vllm-command {command!r} is not a command line") from None
    if shutil.which(program) is None:
        raise EngineError(
            f"--vllm-command {command!r}: {program} is not an executable on PATH (give the "
            "command that starts vLLM's OpenAI server, e.g. 'vllm serve')"
        )


def engine_args(
    command: str, target: str, drafter_dir: Path, block_size: int, port: int
) -> list[str]:
    """The command line of vLLM's OpenAI server for the target with the drafter."""
    spec = {
        "method": "dflash",
        "model": str(drafter_dir),
        # The block's first position is the last accepted token: B-1 drafts a step.
        "num_speculative_tokens": block_size - 1,
    }
    return [
        *shlex.split(command),
        "--model",
        target,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--speculative-config",
        json.dumps(spec),
    ]


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's whole process group, then SIGKILL after STOP_TIMEOUT_S."""
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            # The group may outlive its leader by a moment: one more signal for them.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log_path: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineError(
                f"{what} exited with status {proc.returncode} before serving "
                f"({log_path}: {_last_line(log_path)})"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise EngineError(f"{what} did not serve within {START_TIMEOUT_S:.0f} s (see {log_path})")


@contextlib.contextmanager
def served_drafter(
    command: str, target: str, drafter_dir: Path, block_size: int, log_dir: Path
) -> Iterator[str]:
    """vLLM serving `target` with `drafter_dir` until the block ends; -> its base URL."""
    port = _free_port()
    args = engine_args(command, target, drafter_dir, block_size, port)
    log_path = log_dir / LOG_NAME
    what = f"--vllm-command {command!r}"
    with open(log_path, "wb") as out:
        try:
            proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as err:
            raise EngineError(f"{what} cannot start: {err.strerror or err}") from None
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}", log_path, what)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def measure_with_vllm(
    command: str,
    target: TokenizerTarget,
    drafter_dir: Path,
    block_size: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...],
    log_dir: Path,
    log: Log = say,
) -> ServedFigures:
    """τ of the saved drafter as vLLM serves it: the eval figures, measured by the engine."""
    log(f"eval: starting vLLM with {drafter_dir} ({command}; its output in {log_dir / LOG_NAME})")
    with served_drafter(command, target.spec, drafter_dir, block_size, log_dir) as url:
        client = CompletionClient(ServerSettings(url, retries=1))
        client.connect(target, log, command="eval")
        result = evaluate_served(client, prompts, max_new_tokens, stop_token_ids, log=log)
    figures = result.figures(server="vllm", vllm_command=command)
    for line in format_served(figures, f"vLLM ({command})"):
        log(line)
    return figures
