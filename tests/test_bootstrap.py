"""Sourcing scripts/bootstrap.sh leaves the caller's shell options alone, and every
checkout runs its own code.

The venvs of the first tests are stand-ins whose stamps already match this checkout, so
nothing is installed (and the shared deps venv is never touched).
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
    digest = hashlib.sha256(
        (ROOT / "constraints.txt").read_bytes() + (ROOT / "pyproject.toml").read_bytes()
    ).hexdigest()[:12]
    deps, venv = tmp_path / "deps", tmp_path / "venv"
    for fake in (deps, venv):
        (fake / "bin").mkdir(parents=True)
        python = fake / "bin" / "python"
        python.write_text("#!/bin/sh\nexit 0\n")
        python.chmod(0o755)
    (deps / ".dflash-deps-stamp").write_text(f"{digest}\n")
    (venv / ".dflash-stamp").write_text(f"{digest} {deps} {ROOT}\n")
    return venv


def _bash(script: str, venv: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_VENV": str(venv), "DFLASH_DEPS_VENV": str(venv.parent / "deps")}
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
    assert f"path={venv}/bin:{venv.parent / 'deps'}/bin:" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failing_bootstrap_returns_instead_of_closing_the_shell(tmp_path: Path) -> None:
    venv = tmp_path / "not-a-venv"
    result = _bash(
        "PYTHON=/nonexistent/python source scripts/bootstrap.sh; echo rc=$?; echo still-here",
        venv,
    )
    assert "rc=1" in result.stdout and "still-here" in result.stdout
    assert "bootstrap: failed" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and a checkout")  # fmt: skip
def test_two_clones_bootstrapped_in_turn_each_import_their_own_dflash(tmp_path: Path) -> None:
    """The deps venv is shared (nothing downloads here); each clone gets its own small
    venv, so using one after the other never runs the other's code."""
    clones = [tmp_path / "a", tmp_path / "b"]
    for clone in clones:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_VENV", "PYTHONPATH")}
    env["DFLASH_CACHE_DIR"] = str(tmp_path / "cache")
    env["DFLASH_DEPS_VENV"] = os.environ.get("DFLASH_DEPS_VENV") or _deps_of_this_session()
    where = "python -c 'import dflash, sys; print(dflash.__file__, sys.prefix)'"
    seen = []
    for clone in (*clones, *clones):  # a, b, then a and b again
        result = subprocess.run(["bash", "-c", f"source scripts/bootstrap.sh && {where}"],
                                cwd=clone, env=env, capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr
        module, prefix = result.stdout.split()
        assert Path(module).is_relative_to(clone), (clone, module)
        seen.append(prefix)
    assert seen[0] == seen[2] != seen[1] == seen[3]  # one venv per checkout, kept


def _deps_of_this_session() -> str:
    """The deps venv the suite runs on: this interpreter's, as the .pth file names it."""
    import site

    for directory in site.getsitepackages():
        pth = Path(directory) / "_dflash_deps.pth"
        if pth.is_file():
            return str(Path(pth.read_text().split("'")[1]).parents[3])
    pytest.skip("not running from a bootstrapped checkout venv")
    raise AssertionError
