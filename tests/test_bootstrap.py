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


def _checkout_venv(cache: Path, root: Path = ROOT) -> Path:
    """Where bootstrap.sh keeps the small venv of checkout `root`: keyed by its path."""
    return cache / "checkouts" / hashlib.sha256(str(root).encode()).hexdigest()[:12]


def _fake_venvs(tmp_path: Path) -> tuple[Path, Path]:
    """Stand-in (deps, checkout) venvs whose stamps match this checkout, so nothing is
    installed; the deps hold one console script, `torchrun`, as pip writes them, and
    each `python` says which venv it is."""
    digest = hashlib.sha256(
        (ROOT / "constraints.txt").read_bytes() + (ROOT / "pyproject.toml").read_bytes()
    ).hexdigest()[:12]
    deps, venv = tmp_path / "deps", _checkout_venv(tmp_path / "cache")
    for fake in (deps, venv):
        (fake / "bin").mkdir(parents=True)
        python = fake / "bin" / "python"
        python.write_text(f'#!/bin/sh\necho "python of {fake}:" "$@"\n')
        python.chmod(0o755)
    script = deps / "bin" / "torchrun"
    script.write_text(f"#!{deps}/bin/python\nfrom torch.distributed.run import main\n")
    script.chmod(0o755)
    (deps / ".dflash-deps-stamp").write_text(f"{digest}\n")
    (venv / ".dflash-stamp").write_text(f"{digest} {deps} {ROOT}\n")
    return deps, venv


def _bash(script: str, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    """`script` in bash from the checkout, with the stand-in venvs of `tmp_path`."""
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_VENV"}
    env.update(DFLASH_CACHE_DIR=str(tmp_path / "cache"), DFLASH_DEPS_VENV=str(tmp_path / "deps"))
    env.update(extra)
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sourcing_leaves_the_shell_options_alone(tmp_path: Path) -> None:
    deps, venv = _fake_venvs(tmp_path)
    result = _bash(
        "source scripts/bootstrap.sh; false; echo survived-false; "
        'echo "opts=$-"; set -o | grep -E "^(pipefail|nounset)"; echo "unset=$NOT_SET_ANYWHERE"; '
        'echo "path=$PATH"',
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "survived-false" in out  # errexit would have closed the shell at `false`
    opts = next(line for line in out.splitlines() if line.startswith("opts="))
    assert "e" not in opts.removeprefix("opts=") and "u" not in opts.removeprefix("opts=")
    assert "pipefail      \toff" in out or "pipefail\toff" in out.replace(" ", "")
    assert "nounset" in out and "unset=" in out
    assert f"path={venv}/bin:{deps}/bin:" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failing_bootstrap_returns_instead_of_closing_the_shell(tmp_path: Path) -> None:
    result = _bash(
        "PYTHON=/nonexistent/python source scripts/bootstrap.sh; echo rc=$?; echo still-here",
        tmp_path,
    )
    assert "rc=1" in result.stdout and "still-here" in result.stdout
    assert "bootstrap: failed" in result.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_deps_console_scripts_run_with_the_checkouts_interpreter(tmp_path: Path) -> None:
    """`torchrun` on PATH is a wrapper in the checkout's venv that hands the deps' script
    to the checkout's python, which imports this checkout's code from any folder."""
    deps, venv = _fake_venvs(tmp_path)
    result = _bash(
        "source scripts/bootstrap.sh && command -v torchrun && cd / && torchrun --nproc-per-node 2",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    where, said = result.stdout.splitlines()
    assert where == f"{venv}/bin/torchrun"
    assert said == f"python of {venv}: {deps}/bin/torchrun --nproc-per-node 2"
    assert not (venv / "bin" / "pip").exists()  # installs still go to the deps venv


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_checkout_venv_is_its_own_whatever_the_shell_had_active(tmp_path: Path) -> None:
    """A shell in which another checkout's bootstrap was sourced exports that checkout's
    DFLASH_VENV: this checkout still gets (and installs into) its own."""
    _, venv = _fake_venvs(tmp_path)
    other = tmp_path / "cache" / "checkouts" / "of-another-checkout"
    (other / "bin").mkdir(parents=True)
    (other / ".dflash-stamp").write_text("another checkout's stamp\n")
    active = {"DFLASH_VENV": str(other), "PATH": f"{other}/bin:{os.environ['PATH']}"}
    result = _bash('source scripts/bootstrap.sh && echo "$DFLASH_VENV"', tmp_path, **active)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(venv)
    assert (other / ".dflash-stamp").read_text() == "another checkout's stamp\n"  # untouched


NO_CHECKOUT = shutil.which("git") is None or not (ROOT / ".git").exists()


@pytest.mark.slow
@pytest.mark.skipif(NO_CHECKOUT, reason="needs git and a checkout")
def test_two_clones_bootstrapped_in_turn_each_import_their_own_dflash(tmp_path: Path) -> None:
    """The deps venv is shared (nothing downloads here); each clone gets its own small
    venv, so using one after the other never runs the other's code."""
    clones = [tmp_path / "a", tmp_path / "b"]
    for clone in clones:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
        # The bootstrap under test is this working tree's, committed or not.
        shutil.copy(ROOT / "scripts" / "bootstrap.sh", clone / "scripts" / "bootstrap.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_VENV", "PYTHONPATH")}
    env["DFLASH_CACHE_DIR"] = str(tmp_path / "cache")
    env["DFLASH_DEPS_VENV"] = os.environ.get("DFLASH_DEPS_VENV") or _deps_of_this_session()
    where = "python -c 'import dflash, sys; print(dflash.__file__, sys.prefix)'"
    command = ["bash", "-c", f"source scripts/bootstrap.sh && {where}"]
    seen = []
    for clone in (*clones, *clones):  # a, b, then a and b again
        result = subprocess.run(
            command, cwd=clone, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        module, prefix = result.stdout.split()
        assert Path(module).is_relative_to(clone), (clone, module)
        seen.append(prefix)
    assert seen[0] == seen[2] != seen[1] == seen[3]  # one venv per checkout, kept

    # One shell: a's bootstrap, then b's (a's DFLASH_VENV exported meanwhile), then
    # torchrun from a folder of neither: b's code, and a's venv still a's own.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "where.py").write_text("import dflash, sys\nprint(dflash.__file__, sys.prefix)\n")
    shell = (
        f"source {clones[0]}/scripts/bootstrap.sh && cd {clones[1]} && "
        f"source scripts/bootstrap.sh && cd {elsewhere} && torchrun --nproc-per-node 1 where.py"
    )
    result = subprocess.run(
        ["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    module, prefix = result.stdout.split()
    assert Path(module).is_relative_to(clones[1]) and prefix == seen[1], result.stdout
    a_python = [f"{seen[0]}/bin/python", "-c", "import dflash; print(dflash.__file__)"]
    check = subprocess.run(
        a_python, env=env, cwd=elsewhere, capture_output=True, text=True, timeout=60
    )
    assert Path(check.stdout.strip()).is_relative_to(clones[0]), check.stdout + check.stderr


def _deps_of_this_session() -> str:
    """The deps venv the suite runs on: this interpreter's, as the .pth file names it."""
    import site

    for directory in site.getsitepackages():
        pth = Path(directory) / "_dflash_deps.pth"
        if pth.is_file():
            return str(Path(pth.read_text().split("'")[1]).parents[3])
    pytest.skip("not running from a bootstrapped checkout venv")
    raise AssertionError
