"""Bad input as a user meets it: each case runs the real `dflash-train` command and must end
with one `Error:` line, the right exit code, no traceback, quickly, and leave an earlier
run's folder byte for byte as it was. Prints one line per case and the count.

Usage: python bench/bad_input.py [--keep DIR]   (needs the built-in tiny target: it is
prepared once, a few minutes, and cached; the cases then take about a minute)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SMALL = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--drafter-layers", "1",
         "--block-size", "4", "--num-anchors", "4", "--eval-prompts", "0"]  # fmt: skip


@dataclass
class Case:
    name: str
    args: list[str]
    fragment: str
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)
    within_s: float = 15.0


def folder_state(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".dflash-run.lock"
    }


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run(["dflash-train", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)  # fmt: skip


def cases(work: Path) -> list[Case]:
    done, corpus, blocker = work / "done", work / "corpus.txt", work / "a-file"
    data = ["--data", str(corpus)]
    chats = work / "chats.jsonl"
    reply = "a reply far longer than one row of the run " * 4
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": reply}]}) + "\n"
        for i in range(20)))  # fmt: skip
    utf16 = work / "utf16.yaml"
    utf16.write_bytes("steps: 3\n".encode("utf-16"))
    twice = work / "twice.yaml"
    twice.write_text("steps: 3\nrun:\n  steps: 4\n")
    new = ["--output-dir", str(work / "new")]
    return [
        Case("block size 1", ["train", "--block-size", "1", *new], "--block-size"),
        Case("config not UTF-8", ["train", "--config", str(utf16), *new], "not UTF-8"),
        Case("config key twice", ["train", "--config", str(twice), *new], "set twice"),
        Case("output dir not UTF-8", ["train", "--output-dir", "runs/a\udcffb"], "UTF-8 text"),
        Case("100000 drafter layers", ["train", *SMALL, *data, "--drafter-layers", "100000",
                                       *new], "--allow-over-memory"),  # fmt: skip
        Case("seq len 1e6", ["train", *data, "--seq-len", "1000000", *new], "--allow-over-memory"),
        Case("seq len 1e11", ["train", *data, "--seq-len", "100000000000", *new], "GiB on"),
        Case("hub id offline", ["train", "--target", "no-org/no-model", *SMALL, *data, *new],
             "cannot be reached", env={"HF_HUB_OFFLINE": "1"}, within_s=20),
        Case("eval --json under a file", ["eval", "--drafter", str(done / "drafter"), "--json",
                                          f"{blocker}/e.json"], "--json"),  # fmt: skip
        Case("regenerate --output under a file",
             ["regenerate", "--output", f"{blocker}/r.jsonl"], "--output"),
        Case("cache-hidden --output under a file",
             ["cache-hidden", "--output", f"{blocker}/c"], "--output"),
        Case("export --output under a file", ["export", "--drafter", str(done / "drafter"),
                                              "--output", f"{blocker}/d"], "--output"),  # fmt: skip
        Case("--trace-file a folder", ["train", *SMALL, *data, "--trace-file", str(work), *new],
             "--trace-file"),
        Case("DFLASH_CACHE_DIR a file", ["train", *SMALL, *data, *new], "DFLASH_CACHE_DIR",
             env={"DFLASH_CACHE_DIR": str(blocker)}),
        Case("train into a finished run", ["train", *SMALL, *data, "--output-dir", str(done)],
             "holds an earlier run"),
        Case("resume with another block size", ["train", *SMALL, *data, "--output-dir", str(done),
                                                "--resume", "latest", "--block-size", "8"],
             "block_size"),  # fmt: skip
        Case("resume with other data", ["train", *SMALL, "--data", str(chats), "--output-dir",
                                        str(done), "--resume", "latest"], "data.source"),
        Case("report.html a folder", ["report", str(work / "report-folder")], "report.html"),
        Case("stop token outside the vocabulary",
             ["regenerate", "--data", str(corpus), "--output", str(work / "r.jsonl"),
              "--stop-token-ids", "99999999"], "not in the vocabulary", within_s=120),
        Case("data that cannot train", ["train", *SMALL, "--data", str(chats), *new], "drops"),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="work in this folder and keep it")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="bad-input-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    (work / "a-file").write_text("x")
    done = work / "done"
    if not (done / "summary.json").exists():
        first = run(["train", *SMALL, "--data", str(work / "corpus.txt"), "--save-every", "2",
                     "--output-dir", str(done)])  # fmt: skip
        if first.returncode != 0:
            print(first.stderr[-2000:], file=sys.stderr)
            return 1
    report_folder = work / "report-folder"
    if not report_folder.exists():
        subprocess.run(["cp", "-r", str(done), str(report_folder)], check=True)
        (report_folder / "report.html").unlink()
        (report_folder / "report.html").mkdir()
    before = folder_state(done)
    good = 0
    all_cases = cases(work)
    for case in all_cases:
        started = time.monotonic()
        result = run(case.args, case.env, timeout=300)
        took = time.monotonic() - started
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        problems = []
        if result.returncode != case.code:
            problems.append(f"exit {result.returncode}, not {case.code}")
        if len(errors) != 1:
            problems.append(f"{len(errors)} Error: lines")
        elif case.fragment not in errors[0]:
            problems.append(f"no {case.fragment!r} in the line")
        if "Traceback" in result.stderr:
            problems.append("a traceback")
        if took > case.within_s:
            problems.append(f"{took:.1f} s")
        if folder_state(done) != before:
            problems.append("the earlier run's folder changed")
            before = folder_state(done)
        good += not problems
        shown = errors[0][:110] if errors else result.stderr.strip()[-110:]
        mark = "ok  " if not problems else "FAIL"
        print(f"{mark} {case.name:<36} {took:5.1f}s  {'; '.join(problems) or shown}")
    print(f"{good} of {len(all_cases)} bad-input cases: one line, the right exit code, "
          "no traceback, in time, the earlier run unchanged")  # fmt: skip
    return 0 if good == len(all_cases) else 1


if __name__ == "__main__":
    sys.exit(main())
