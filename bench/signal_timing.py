"""A signal in the first seconds of a command, as a user's Ctrl-C, a scheduler's SIGTERM or
a closed terminal's SIGHUP meets it: `train`, `eval` and `regenerate` are started as real
processes and signalled 0.1, 0.3, 0.8, 1.5 and 5 s after start (during the interpreter's
start-up, the command line's imports, torch's import, the target's load, the work). Every
time: exit code 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP), exactly one `stopped by`
line, no traceback.

Usage: python bench/signal_timing.py [--keep DIR] [--delays 0.1,0.3] [--signals INT,TERM,HUP]
(needs the built-in tiny target, prepared once and cached; about 30 runs of a few seconds)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = ["--batch-size", "2", "--seq-len", "32", "--drafter-layers", "1", "--block-size", "4",
         "--num-anchors", "4", "--eval-prompts", "0"]  # fmt: skip
DELAYS_S = (0.1, 0.3, 0.8, 1.5, 5.0)


def prepare(work: Path) -> None:
    """A corpus and a finished run whose drafter `eval` measures."""
    corpus = work / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    many = work / "many.txt"  # regenerate's work: enough documents to outlast 5 s
    if not many.exists():
        many.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(4000)))
    done = work / "done"
    if not (done / "summary.json").exists():
        subprocess.run(["dflash-train", "train", *SMALL, "--steps", "4", "--data", str(corpus),
                        "--output-dir", str(done)], check=True, capture_output=True)  # fmt: skip


def command(name: str, work: Path, tag: str) -> list[str]:
    """A run of `name` that is still working 5 s after its start."""
    corpus = str(work / "corpus.txt")
    if name == "train":
        return ["train", *SMALL, "--steps", "100000", "--data", corpus,
                "--output-dir", str(work / f"train-{tag}")]  # fmt: skip
    if name == "eval":
        return ["eval", "--drafter", str(work / "done" / "drafter"), "--data", corpus,
                "--eval-prompts", "1000", "--max-new-tokens", "64"]  # fmt: skip
    return ["regenerate", "--data", str(work / "many.txt"), "--max-new-tokens", "128",
            "--output", str(work / f"regen-{tag}.jsonl")]  # fmt: skip


def signalled(args: list[str], signum: int, delay_s: float) -> tuple[int, str, float]:
    """(exit code, standard error, seconds from the signal to the exit)."""
    child = subprocess.Popen(["dflash-train", *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(delay_s)
    if child.poll() is not None:  # the bench's fault, not the command's: say so
        _, err = child.communicate()
        return child.returncode, f"ended before the signal\n{err}", 0.0
    sent = time.monotonic()
    child.send_signal(signum)
    try:
        _, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        _, err = child.communicate()
        return -9, err, time.monotonic() - sent
    code = child.returncode if child.returncode >= 0 else 128 - child.returncode
    return code, err, time.monotonic() - sent


def problems(code: int, err: str, signum: int) -> list[str]:
    found = []
    if code != 128 + signum:
        found.append(f"exit {code}")
    stops = [line for line in err.splitlines() if "stopped by" in line]
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    if len(stops) != 1 or errors != [line for line in stops if line.startswith("Error:")]:
        found.append(f"{len(stops)} stop lines, {len(errors)} Error: lines")
    if "Traceback" in err or "KeyboardInterrupt" in err:
        found.append("a traceback")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="work in this folder and keep it")
    parser.add_argument("--delays", default=",".join(map(str, DELAYS_S)))
    parser.add_argument("--signals", default="INT,TERM,HUP")
    parser.add_argument("--commands", default="train,eval,regenerate")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="signal-timing-"))
    work.mkdir(parents=True, exist_ok=True)
    prepare(work)
    delays = [float(d) for d in args.delays.split(",")]
    signums = [getattr(signal, f"SIG{name}") for name in args.signals.split(",")]
    good = total = 0
    print(f"{'command':<11} {'signal':<8} {'after':>6}  {'exit':>4}  {'to exit':>7}  line")
    for name in args.commands.split(","):
        for signum in signums:
            for delay_s in delays:
                tag = f"{signal.Signals(signum).name}-{delay_s}-{os.getpid()}"
                code, err, took_s = signalled(command(name, work, tag), signum, delay_s)
                found = problems(code, err, signum)
                stops = [line for line in err.splitlines() if "stopped by" in line]
                shown = "; ".join(found) if found else stops[0]
                mark = "ok  " if not found else "FAIL"
                print(f"{name:<11} {signal.Signals(signum).name:<8} {delay_s:>5.1f}s  {code:>4}  "
                      f"{took_s:>6.1f}s  {mark} {shown[:90]}", flush=True)  # fmt: skip
                if found and os.environ.get("SIGNAL_TIMING_SHOW"):
                    print(err[-3000:], file=sys.stderr)
                good += not found
                total += 1
    print(f"{good} of {total} signalled runs: one line, exit 130/143/129, no traceback")
    return 0 if good == total else 1


if __name__ == "__main__":
    sys.exit(main())
