"""Sourcing scripts/bootstrap.sh leaves the caller's shell options alone.

The venv here is a stand-in whose stamp already matches this checkout, so nothing is
installed (and the shared venv is never touched).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    digest = hashlib.sha256(
        (ROOT / "constraints.txt").read_bytes() + (ROOT / "pyproject.toml").read_bytes()
    ).hexdigest()[:12]
    (venv / ".dflash-stamp").write_text(f"{digest} {ROOT}\n")
    return venv


def _bash(script: str, venv: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_VENV": str(venv)}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sourcing_leaves_the_shell_options_alone(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path)
    result = _bash(
        "source scripts/bootstrap.sh; false; echo survived-false; "
        'echo "opts=$-"; set -o | grep -E "^(pipefail|nounset)"; echo "unset=$NOT_SET_ANYWHERE"; '
        'echo "path=$PATH"',
        venv,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "survived-false" in out  # errexit would have closed the shell at `false`
    opts = next(line for line in out.splitlines() if line.startswith("opts="))
    assert "e" not in opts.removeprefix("opts=") and "u" not in opts.removeprefix("opts=")
    assert "pipefail      \toff" in out or "pipefail\toff" in out.replace(" ", "")
    assert "nounset" in out and "unset=" in out
    assert f"path={venv}/bin:" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failing_bootstrap_returns_instead_of_closing_the_shell(tmp_path: Path) -> None:
    venv = tmp_path / "not-a-venv"
    result = _bash(
        "PYTHON=/nonexistent/python source scripts/bootstrap.sh; echo rc=$?; echo still-here",
        venv,
    )
    assert "rc=1" in result.stdout and "still-here" in result.stdout
    assert "bootstrap: failed" in result.stderr
