"""`regenerate --output` as a shared disk meets it: one writer at a time, and a full disk
that costs one line and leaves whole lines only. Real processes, a real file-size limit
(a write past it fails as on a full disk) and real locks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.dflash.app_fixtures import ROOT, script_env

_REGENERATE = """
import resource, signal, sys
sys.path.insert(0, {root!r})
from tests.dflash.app_fixtures import small_target_everywhere
small_target_everywhere()
if {limit!r} is not None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit!r}, {limit!r}))
sys.argv = ["dflash-train", "regenerate", *{args!r}]
from dflash.cli import main
main()
"""


def corpus(tmp_path: Path, functions: int) -> Path:
    """Text whose windows all differ, so that a line written twice shows."""
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(functions)))
    return path


def regenerate(args: list[str], limit: int | None = None) -> subprocess.Popen:
    code = textwrap.dedent(_REGENERATE).format(root=str(ROOT), args=args, limit=limit)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen([sys.executable, "-c", code], env=script_env(), **pipes)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def test_two_writers_of_one_output_the_second_refused_at_once(tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    args = ["--data", str(corpus(tmp_path, 1200)), "--output", str(out)]
    args += ["--chunk-lines", "4", "--max-new-tokens", "32"]
    first = regenerate(args)
    lock = tmp_path / ".regen.jsonl.dflash-lock"
    deadline = time.monotonic() + 120
    while not lock.exists():  # the first has passed its checks and holds the output
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    started = time.monotonic()
    # The command itself (no test fixture to import first): refused before any target.
    command = [sys.executable, "-m", "dflash.cli", "regenerate", *args]
    second = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=120)
    err = second.stderr
    refused_s = time.monotonic() - started
    assert first.poll() is None, "the first ended before the second could be refused"
    assert second.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == errors(err)  # the Error: line alone
    (line,) = errors(err)
    held = f"Error: --output {str(out)!r} is being written by another process (pid {first.pid} on "
    assert line.startswith(held), line
    assert refused_s < 2.0, refused_s  # before torch imports, let alone the target loads
    assert first.wait(timeout=600) == 0, first.communicate()
    lines = out.read_text().splitlines()
    record = json.loads((tmp_path / "regen.jsonl.run.json").read_text())
    assert len(lines) == record["lines"] and len(set(lines)) == len(lines)  # each line once
    assert not lock.exists()


def test_a_full_disk_is_one_line_and_leaves_whole_lines_that_a_rerun_continues(tmp_path) -> None:
    data = corpus(tmp_path, 200)
    flags = ["--data", str(data), "--chunk-lines", "2", "--max-new-tokens", "8"]
    reference = tmp_path / "reference.jsonl"
    assert regenerate([*flags, "--output", str(reference)]).wait(timeout=600) == 0
    out = tmp_path / "regen.jsonl"
    limited = regenerate([*flags, "--output", str(out)], limit=reference.stat().st_size // 2)
    _, err = limited.communicate(timeout=600)
    assert limited.returncode == 2 and "Traceback" not in err, err
    (line,) = errors(err)
    text = out.read_text()
    complete = text.count("\n")
    assert 0 < complete < reference.read_text().count("\n") and text.endswith("\n")
    assert reference.read_text().startswith(text)  # whole lines, no partial last one
    assert line.startswith(f"Error: --output {out}: could not write (File too large; ")
    assert "GiB free there" in line and f"its first {complete} lines are complete" in line
    assert regenerate([*flags, "--output", str(out)]).wait(timeout=600) == 0  # room again
    assert out.read_text() == reference.read_text()
