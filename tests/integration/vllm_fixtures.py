"""The real vLLM engine for the tests: its venv (tools/vllm/venv.sh) and SmolLM2-135M-Instruct
as a Hugging Face folder (tools/vllm/model.sh), both made once and cached; plain helpers,
and the session fixtures `vllm_python` and `smollm2_dir` on them. A test module imports
the fixtures' functions, which are named apart so that its arguments shadow nothing:

    from vllm_fixtures import smollm2_dir_fixture, vllm_python_fixture  # noqa: F401

Without the venv the tests skip with how to make it; DFLASH_REQUIRE_VLLM=1 (CI) fails them
instead. vLLM's engine-core and worker processes outlive a parent that dies without
shutting them down, at gigabytes each: `vllm_env` marks every process a test starts, and
`engine_leftovers` finds (and `end_leftovers` ends) those that remain, and only those.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import NoReturn

import pytest
from conftest import REPO_ROOT

TOOLS = REPO_ROOT / "tools" / "vllm"
VENV_TIMEOUT_S = 1800  # a first build downloads and installs about 6 GB
MODEL_TIMEOUT_S = 900
MARKER = "DFLASH_VLLM_TEST_RUN"  # in the environment of every process a test starts


def dflash_cli(*args: str, timeout_s: float = 1800) -> subprocess.CompletedProcess[str]:
    """`dflash-train ARGS` in this python, its output captured (the caller checks it)."""
    return subprocess.run(
        [sys.executable, "-m", "dflash.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def dflash_ok(*args: str, timeout_s: float = 1800) -> subprocess.CompletedProcess[str]:
    """`dflash_cli` that must succeed; its standard error in the failure."""
    done = dflash_cli(*args, timeout_s=timeout_s)
    assert done.returncode == 0, f"dflash-train {args[0]} failed:\n{done.stderr[-3000:]}"
    return done


def vllm_unavailable(reason: str, script: str = "venv.sh") -> NoReturn:
    """Skips the test, or fails it where CI demands the real engine."""
    cost = " (about 6 GB, a few minutes)" if script == "venv.sh" else ""
    hint = f"{reason}; make it with `bash tools/vllm/{script}`{cost}"
    if os.environ.get("DFLASH_REQUIRE_VLLM") == "1":
        pytest.fail(f"{hint} (DFLASH_REQUIRE_VLLM=1: the vLLM tests must run)", pytrace=False)
    pytest.skip(hint)


def run_tool(script: str, timeout_s: float) -> Path:
    """Runs tools/vllm/SCRIPT and returns the path it prints last."""
    env = {**os.environ, "PYTHON": sys.executable}  # model.sh's transformers: the project's
    try:
        done = subprocess.run(
            ["bash", str(TOOLS / script)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        vllm_unavailable(f"tools/vllm/{script} took longer than {timeout_s:.0f} s", script)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        vllm_unavailable(f"tools/vllm/{script} failed:\n{done.stderr[-2000:]}", script)
    return Path(lines[-1])


def find_vllm_python() -> Path:
    """The venv's python, once it imports vLLM's parts the tests use."""
    python = run_tool("venv.sh", VENV_TIMEOUT_S)
    probe = "import importlib.util as u; assert u.find_spec('vllm') and u.find_spec('psutil')"
    try:
        done = subprocess.run(
            [str(python), "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        vllm_unavailable(f"the vLLM venv's python {python} does not run ({err})")
    if done.returncode != 0:
        vllm_unavailable(f"the vLLM venv at {python} is broken:\n{done.stderr[-1000:]}")
    return python


def vllm_env(marker: str) -> dict[str, str]:
    """The environment of a process that runs vLLM on this CPU: a KV cache that fits the
    machine, nothing fetched from the hub, and `marker` to find its processes by."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "HF_HUB_OFFLINE": "1",
        MARKER: marker,
    }


def new_marker() -> str:
    return uuid.uuid4().hex


def engine_leftovers(marker: str) -> list[int]:
    """Processes still alive that were started under `marker` (vLLM's `VLLM::` ones, and
    anything else of that run): other runs on the machine are not touched."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def end_leftovers(marker: str) -> list[int]:
    """Kills what `engine_leftovers` finds; -> their pids."""
    pids = engine_leftovers(marker)
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return pids


def find_smollm2() -> Path:
    """SmolLM2-135M-Instruct's Hugging Face folder (config.json, model.safetensors, tokenizer)."""
    return run_tool("model.sh", MODEL_TIMEOUT_S)


@pytest.fixture(scope="session", name="vllm_python")
def vllm_python_fixture() -> Path:
    return find_vllm_python()


@pytest.fixture(scope="session", name="smollm2_dir")
def smollm2_dir_fixture() -> Path:
    return find_smollm2()
