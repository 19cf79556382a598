"""Bad input as a user meets it: each case runs the real `dflash-train` command and must end
with one `Error:` line (the line alone on standard error), the right exit code, no
traceback, quickly, and leave an earlier run's folder byte for byte as it was. A few cases
are the good outcome of what used to fail (a damaged cache repaired, UNK as the mask
token, torchrun from another folder): exit 0 and their line. Prints one line per case and
the count. Signals in the first seconds: bench/signal_timing.py.

Usage: python bench/bad_input.py [--keep DIR] [--group NAME ...]   (needs the built-in
tiny target: it is prepared once, a few minutes, and cached; the cases then take a few
minutes; `--group` runs one group of cases, GROUPS)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--drafter-layers", "1",
         "--block-size", "4", "--num-anchors", "4", "--eval-prompts", "0"]  # fmt: skip
# A process whose writes past `limit` bytes fail as on a full disk, running dflash-train.
FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
sys.argv = ["dflash-train", *sys.argv[1:]]
from dflash.cli import main
main()
"""
# Holds the lock of an output as a writer does, until killed.
HOLDER = """
import sys, time
from dflash.run.folder import FolderLock
FolderLock.for_output(sys.argv[1], "--output").acquire()
print("locked", flush=True)
time.sleep(600)
"""


@dataclass
class Case:
    name: str
    args: list[str]
    fragment: str
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)
    within_s: float = 15.0
    program: list[str] = field(default_factory=lambda: ["dflash-train"])
    cwd: Path | None = None
    # Started before the case (another writer), stopped after it; `check` may add problems.
    before: Callable[[], subprocess.Popen] | None = None
    check: Callable[[subprocess.Popen | None], list[str]] | None = None
    root_only: bool = False  # as root, permission bits say yes to everything
    alone: bool = True  # the Error: line is all of standard error


def folder_state(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".dflash-run.lock"
    }


def run(
    args: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 600,
    program: list[str] | None = None,
    cwd: Path | None = None,
):
    return subprocess.run(
        [*(program or ["dflash-train"]), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        cwd=cwd,
    )


def start(command: list[str], wait_for: Path | None = None) -> subprocess.Popen:
    """A process in the background; with `wait_for`, once that path exists."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while wait_for is not None and not wait_for.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{command[:3]} did not start: {child.communicate()[1][-500:]}")
        time.sleep(0.02)
    return child


def holder(output: Path) -> Callable[[], subprocess.Popen]:
    def begin() -> subprocess.Popen:
        child = start([sys.executable, "-c", HOLDER, str(output)])
        assert child.stdout is not None and child.stdout.readline() == "locked\n"
        return child

    return begin


def lines_once(output: Path) -> Callable[[subprocess.Popen | None], list[str]]:
    """After the first writer ends: the file holds each line once, as many as its record."""

    def check(first: subprocess.Popen | None) -> list[str]:
        if first is None or first.poll() is not None:
            return ["the first writer ended before the second was refused"]
        if first.wait(timeout=600) != 0:
            return [f"the first writer failed: {first.communicate()[1][-200:]}"]
        lines = output.read_text().splitlines()
        wanted = json.loads(output.with_name(output.name + ".run.json").read_text())["lines"]
        if len(lines) != wanted or len(set(lines)) != len(lines):
            return [f"{len(lines)} lines ({len(set(lines))} distinct), the record says {wanted}"]
        return []

    return check


def silent_hub() -> str:
    """An endpoint that takes TCP connections (the kernel's backlog) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    silent_hub.keep = server  # type: ignore[attr-defined]  # open while the cases run
    return f"http://127.0.0.1:{server.getsockname()[1]}"


def damage_caches(work: Path, corpus: Path) -> tuple[Path, Path]:
    """Two hidden-state caches of the small run: one with a flipped byte in a shard, one
    with a shard deleted."""
    flipped, gone = work / "cache-flipped", work / "cache-gone"
    for cache in (flipped, gone):
        shutil.rmtree(cache, ignore_errors=True)
        made = run(["cache-hidden", *CACHE, "--data", str(corpus), "--output", str(cache)])
        if made.returncode != 0:
            raise RuntimeError(made.stderr[-1000:])
    shard = flipped / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    (gone / "shard-00001.safetensors").unlink()
    return flipped, gone


CACHE = [
    *SMALL[:2],
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--drafter-layers",
    "1",
    "--batches-per-shard",
    "2",
]


def unk_only_target(work: Path) -> tuple[Path, Path]:
    """A Qwen3-shaped target whose tokenizer has BOS, EOS, PAD and UNK only and no spare
    embedding row (as Llama-2 or TinyLlama), and chats in its words; and a GPT-2."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from tests.dflash.hf_fixtures import WORDS, qwen3_config, save_word_tokenizer

    target, gpt2 = work / "unk-target", work / "gpt2-target"
    if not (target / "config.json").exists():
        tok = save_word_tokenizer(target)
        torch.manual_seed(0)
        config = qwen3_config(len(tok), eos_token_id=tok.eos_token_id)
        AutoModelForCausalLM.from_config(config).save_pretrained(target)
    if not (gpt2 / "config.json").exists():
        tok = save_word_tokenizer(gpt2)
        small = GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        GPT2LMHeadModel(small).save_pretrained(gpt2)
    chats = work / "word-chats.jsonl"
    reply = {"role": "assistant", "content": " ".join(WORDS[2:])}
    chats.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"print {word}"}, reply]}) + "\n"
            for word in WORDS * 2
        )
    )
    return target, gpt2


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
        Case("dpace alpha 0", ["train", "--position-weighting", "dpace", "--dpace-alpha", "0",
             *new], "--dpace-alpha 0.0"),
        Case("dpace alpha without dpace", ["train", "--dpace-alpha", "0.4", *new],
             "--dpace-alpha 0.4 needs --position-weighting dpace"),
        Case("dpace and streak alpha", ["train", "--position-weighting", "dpace",
             "--streak-alpha", "0.5", *new], "--streak-alpha 0.5 is invalid"),
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


def ownership_cache_and_deadline_cases(work: Path, hub: str) -> list[Case]:
    """Outputs aimed at a run's own files, two writers of one output, writability as
    root, caches, deadlines, long names and full disks, one line, UNK, torchrun."""
    done, corpus = work / "done", work / "corpus.txt"
    data, drafter = ["--data", str(corpus)], str(done / "drafter")
    new = ["--output-dir", str(work / "new")]
    train = ["train", *SMALL, *data]
    long = str(work / ("x" * 300) / "out.json")
    link = work / "link-to-checkpoints"
    if not link.exists():
        link.symlink_to(done / "checkpoints")
    big = work / "functions.txt"  # windows that all differ: a line written twice shows
    big.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(1200)))
    shared = work / "shared.jsonl"
    regen = [
        "regenerate",
        "--data",
        str(big),
        "--output",
        str(shared),
        "--chunk-lines",
        "4",
        "--max-new-tokens",
        "32",
    ]
    flipped, gone = damage_caches(work, corpus)
    unk_target, gpt2 = unk_only_target(work)
    word_chats = str(work / "word-chats.jsonl")
    hub_env = {"HF_ENDPOINT": hub, "HF_HUB_OFFLINE": "0", "HF_HOME": str(work / "hf-home")}
    program = [sys.executable, "-c", FULL_DISK.format(limit=3000)]
    full_train = [sys.executable, "-c", FULL_DISK.format(limit=100_000)]
    elsewhere = Path(tempfile.mkdtemp(prefix="elsewhere-"))
    return [
        # 1. whose file is this
        Case(
            "eval --json onto the drafter's config",
            ["eval", "--drafter", drafter, "--json", f"{drafter}/config.json"],
            "inside --drafter",
        ),
        Case(
            "eval --json onto a run's summary",
            ["eval", "--drafter", drafter, "--json", str(done / "summary.json")],
            "summary.json of the run in",
        ),
        Case(
            "--trace-file onto another run's metrics",
            [*train, *new, "--trace-file", str(done / "metrics.jsonl")],
            "metrics.jsonl of the run",
        ),
        Case(
            "--trace-file onto the run's own metrics",
            [
                *train,
                "--output-dir",
                str(done),
                "--resume",
                "latest",
                "--trace-file",
                str(done / "metrics.jsonl"),
            ],
            "of this run's --output-dir",
        ),
        Case(
            "--timeline onto another run's timeline",
            [*train, *new, "--timeline", str(done / "timeline.json")],
            "timeline.json of the run",
        ),
        Case(
            "--output-dir in another run's checkpoints",
            [*train, "--output-dir", str(done / "checkpoints" / "new")],
            "is inside the run in",
        ),
        Case(
            "--output-dir there by a link",
            [*train, "--output-dir", str(link / "new")],
            "is inside the run in",
        ),
        Case(
            "--trace-file and --timeline one file",
            [
                *train,
                *new,
                "--trace-file",
                str(work / "t.json"),
                "--timeline",
                str(work / "t.json"),
            ],
            "are one path",
        ),
        Case(
            "regenerate --output is its --data",
            ["regenerate", *data, "--output", str(corpus)],
            "is --data",
        ),
        Case(
            "cache-hidden --output is a run",
            ["cache-hidden", *data, "--output", str(done)],
            "holds a training run",
        ),
        Case(
            "export --output is its --drafter",
            ["export", "--drafter", drafter, "--output", drafter],
            "is --drafter",
        ),
        # 2. one writer per output
        Case(
            "two regenerate into one output",
            regen,
            "is being written by another process",
            within_s=2.0,
            before=lambda: start(
                ["dflash-train", *regen], wait_for=work / ".shared.jsonl.dflash-lock"
            ),
            check=lines_once(shared),
        ),
        Case(
            "two cache-hidden into one output",
            ["cache-hidden", *CACHE, *data, "--output", str(work / "held-cache")],
            "is being written by another process",
            within_s=2.0,
            before=holder(work / "held-cache"),
        ),
        Case(
            "two export into one output",
            ["export", "--drafter", drafter, "--output", str(work / "held-export")],
            "is being written by another process",
            within_s=2.0,
            before=holder(work / "held-export"),
        ),
        # 3. writability found by doing (as root every permission check says yes)
        Case(
            "eval --json under /proc",
            ["eval", "--drafter", drafter, "--json", "/proc/e.json"],
            "/proc takes no new files",
            root_only=True,
        ),
        Case(
            "regenerate --output under /proc",
            ["regenerate", *data, "--output", "/proc/r.jsonl"],
            "/proc takes no new files",
            root_only=True,
        ),
        Case(
            "cache-hidden --output under /proc",
            ["cache-hidden", *data, "--output", "/proc/c"],
            "/proc takes no new files",
            root_only=True,
        ),
        Case(
            "--trace-file under /proc",
            [*train, *new, "--trace-file", "/proc/t.json"],
            "/proc takes no new files",
            root_only=True,
        ),
        Case(
            "--output-dir under /proc",
            [*train, "--output-dir", "/proc/run"],
            "/proc/run",
            root_only=True,
        ),
        Case(
            "DFLASH_CACHE_DIR under /proc",
            [*train, *new],
            "DFLASH_CACHE_DIR",
            env={"DFLASH_CACHE_DIR": "/proc/cache"},
            root_only=True,
        ),
        # 5. caches that say complete when they are not
        Case(
            "train from a cache with a flipped byte",
            [*train, *new, "--hidden-cache", str(flipped)],
            "corrupt",
        ),
        Case(
            "cache-hidden rerun repairs the flipped byte",
            ["cache-hidden", *CACHE, *data, "--output", str(flipped)],
            "was corrupt (checksum mismatch): written again",
            code=0,
            alone=False,
            within_s=60,
        ),
        Case(
            "train from a cache with a shard deleted",
            [*train, *new, "--hidden-cache", str(gone)],
            "truncated or missing",
        ),
        Case(
            "cache-hidden rerun writes the deleted shard",
            ["cache-hidden", *CACHE, *data, "--output", str(gone)],
            "was missing: written again",
            code=0,
            alone=False,
            within_s=60,
        ),
        Case(
            "train from the repaired cache",
            [*train, "--output-dir", str(work / "from-cache"), "--hidden-cache", str(gone)],
            "summary:",
            code=0,
            alone=False,
            within_s=90,
        ),
        # 6. deadlines
        Case(
            "train with a hub that never answers",
            ["train", "--target", "no-org/no-model", *SMALL, *data, *new],
            "no answer within 3 s",
            env=hub_env,
            within_s=20,
        ),
        Case(
            "--dry-run with a hub that never answers",
            ["train", "--target", "no-org/no-model", *SMALL, *data, *new, "--dry-run"],
            "no answer within 3 s",
            env=hub_env,
            within_s=20,
        ),
        # 7. paths and disks
        Case(
            "regenerate --output name over 255 bytes",
            ["regenerate", *data, "--output", long],
            "bytes long",
        ),
        Case(
            "eval --json name over 255 bytes",
            ["eval", "--drafter", drafter, "--json", long],
            "bytes long",
        ),
        Case(
            "--trace-file name over 255 bytes", [*train, *new, "--trace-file", long], "bytes long"
        ),
        Case(
            "full disk during regenerate",
            [
                "regenerate",
                *data,
                "--output",
                str(work / "full.jsonl"),
                "--chunk-lines",
                "4",
                "--max-new-tokens",
                "16",
            ],
            "lines are complete",
            program=program,
            alone=False,
            within_s=120,
            check=whole_lines(work / "full.jsonl"),
        ),
        Case(
            "full disk at a checkpoint in training",
            [*train, "--save-every", "2", "--output-dir", str(work / "full-mid")],
            "could not write",
            program=full_train,
            alone=False,
            within_s=60,
        ),
        Case(
            "full disk at the final save",
            [*train, "--output-dir", str(work / "full-final")],
            "could not write",
            program=full_train,
            alone=False,
            within_s=60,
        ),
        # 8. one line means one line (and the checks before the weights)
        Case(
            "a GPT-2 target for train",
            ["train", "--target", str(gpt2), *SMALL, *data, *new],
            "not a Llama/Qwen-style decoder",
        ),
        Case(
            "a GPT-2 target for eval",
            ["eval", "--drafter", drafter, "--target", str(gpt2)],
            "not a Llama/Qwen-style decoder",
        ),
        Case(
            "a GPT-2 target for regenerate",
            ["regenerate", "--target", str(gpt2), *data, "--output", str(work / "g.jsonl")],
            "not a Llama/Qwen-style decoder",
        ),
        # 9. the mask token of last resort
        Case(
            "UNK as the mask token",
            [
                "train",
                "--target",
                str(unk_target),
                "--data",
                word_chats,
                *SMALL,
                "--seq-len",
                "64",
                "--output-dir",
                str(work / "unk"),
            ],
            "the unknown token",
            code=0,
            alone=False,
            within_s=90,
        ),
        # 10. torchrun sees the checkout's code, from any folder
        Case(
            "torchrun -m dflash.cli from another folder",
            ["--version"],
            "dflash-train, version",
            code=0,
            program=["torchrun", "--nproc-per-node", "1", "-m", "dflash.cli"],
            cwd=elsewhere,
            alone=False,
            within_s=60,
        ),
        Case(
            "torchrun $(command -v dflash-train)",
            ["--version"],
            "dflash-train, version",
            code=0,
            program=["torchrun", "--nproc-per-node", "1", shutil.which("dflash-train") or ""],
            cwd=elsewhere,
            alone=False,
            within_s=60,
        ),
    ]


def unwritten_file_and_silent_server_cases(work: Path, hub: str) -> list[Case]:
    """Nothing replaced that the command did not write, failed writes are one line,
    servers and FIFOs that never answer are bounded, unknown variables are told."""
    done, corpus = work / "done", work / "corpus.txt"
    data, drafter = ["--data", str(corpus)], str(done / "drafter")
    new = ["--output-dir", str(work / "new")]
    mine = work / "mine.json"
    mine.write_text('{"mine": 1}\n')
    device = full_device(work)
    fifo = work / "fifo.yaml"
    if not fifo.exists():
        os.mkfifo(fifo)
    fifo_run = work / "fifo-run"
    if not fifo_run.exists():
        shutil.copytree(done, fifo_run)
        (fifo_run / "metrics.jsonl").unlink()
        os.mkfifo(fifo_run / "metrics.jsonl")
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    closed_port = refused.getsockname()[1]
    refused.close()  # nothing listens there now
    full = [sys.executable, "-c", FULL_DISK.format(limit=3000)]
    train_full = ["train", *SMALL, *data, "--output-dir", str(work / "trace-full")]
    return [
        # 2. never replace a file the command did not write
        Case(
            "eval --json onto a user's JSON",
            ["eval", "--drafter", drafter, "--json", str(mine)],
            "was not written by dflash-train eval",
            check=unchanged(mine, '{"mine": 1}\n'),
        ),
        Case(
            "inspect-data --json onto a user's JSON",
            ["inspect-data", *data, "--rows", "0", "--json", str(mine)],
            "was not written by dflash-train inspect-data",
            check=unchanged(mine, '{"mine": 1}\n'),
        ),
        Case(
            "inspect-data --json onto /dev/full",
            ["inspect-data", *data, "--rows", "0", "--json", str(device)],
            "could not write",
            check=still_a_device(device),
        ),
        Case(
            "--trace-file onto /dev/full",
            [*train_full, "--trace-file", str(device)],
            "--trace-file",
            alone=False,
            within_s=60,
            check=still_a_device(device),
        ),
        # 5. servers and files that never answer
        Case(
            "eval --server that never answers",
            ["eval", "--server", hub, "--target", "builtin:tiny"],
            "no answer within 3 s",
        ),
        Case(
            "eval --server where nothing listens",
            ["eval", "--server", f"http://127.0.0.1:{closed_port}", "--target", "builtin:tiny"],
            "connection refused",
        ),
        Case("--config a FIFO", ["train", "--config", str(fifo), *new], "a FIFO"),
        Case("report on a FIFO metrics.jsonl", ["report", str(fifo_run)], "is a FIFO"),
        # 7. unknown settings are told; a full disk in cache-hidden is train's line
        Case(
            "DFLASH_STPES=5",
            ["inspect-data", *data, "--rows", "0"],
            "did you mean DFLASH_STEPS?",
            code=0,
            env={"DFLASH_STPES": "5"},
            alone=False,
        ),
        Case(
            "full disk during cache-hidden",
            ["cache-hidden", *CACHE, *data, "--output", str(work / "full-cache")],
            "could not write",
            program=full,
            alone=False,
            within_s=60,
        ),
    ]


def lying_data_and_damaged_target_cases(work: Path) -> list[Case]:
    """Data that lies is caught, not learned (a server's null replies, a regeneration still
    being written, a cached one cut in half, compressed and JSON files, lines the parser
    cannot take); damaged targets are refused before training, naming what is wrong."""
    done, corpus = work / "done", work / "corpus.txt"
    data, new = ["--data", str(corpus)], ["--output-dir", str(work / "new")]
    texts = [{"text": f"def g{i}(x):\n    return x * {i}\n" * 3} for i in range(20)]
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]})
                               + "\n" for i in range(8)))  # fmt: skip
    partial = work / "regen-partial.jsonl"
    partial.write_text("".join(json.dumps(t) + "\n" for t in texts[:4]))
    record = {"format": 2, "target": "builtin:tiny", "target_hash": "-", "data": "-"}
    record |= {"lines": 20, "settings": {}}
    partial.with_name(partial.name + ".run.json").write_text(json.dumps(record))
    gz_folder = work / "gz-folder"
    gz_folder.mkdir(exist_ok=True)
    with gzip.open(gz_folder / "texts.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(t) + "\n" for t in texts))
    chats_json = work / "chats.json"
    chats_json.write_text(json.dumps([chat, {"messages": [{"role": "wizard", "content": "x"}]}]))
    wizards = work / "wizards.json"
    wizards.write_text(json.dumps([{"messages": [{"role": "wizard", "content": "x"}]}]))
    deep, surrogate = work / "deep.jsonl", work / "surrogate.jsonl"
    lines = "".join(json.dumps(t) + "\n" for t in texts)
    deep.write_text("[" * 200_000 + "\n" + lines)
    surrogate.write_text('{"text": "half \\ud800 of a pair"}\n' + lines)
    regen_cache = cut_regeneration(work)
    missing, nan, bare = damaged_targets(work)
    inspect = ["inspect-data", "--rows", "0", "--seq-len", "64"]
    null = null_server()
    return [
        # 3. data that lies
        Case(
            "regenerate --server answering text null",
            [
                "regenerate",
                "--server",
                null,
                "--target",
                "builtin:tiny",
                "--data",
                str(prompts),
                "--output",
                str(work / "null.jsonl"),
                "--max-new-tokens",
                "8",
            ],
            '"text": null',
            alone=False,
            check=no_text(work / "null.jsonl", "None"),
        ),  # fmt: skip
        Case(
            "train on a regenerate output being written",
            ["train", *SMALL, "--data", str(partial), *new],
            "is still being written by dflash-train regenerate",
            before=holder(partial),
        ),
        Case(
            "train on an unfinished regenerate output",
            ["train", *SMALL, "--data", str(partial), *new],
            "is an unfinished regenerate output: 4 of its 20 lines",
        ),
        Case(
            "train on a cached regeneration cut in half",
            ["train", *SMALL, "--output-dir", str(work / "regen-run")],
            "lines: it is generated again",
            code=0,
            env={"DFLASH_CACHE_DIR": str(regen_cache)},
            alone=False,
            within_s=300,
        ),
        Case(
            "a .jsonl.gz alone in a --data folder",
            [*inspect, "--data", str(gz_folder)],
            "19 training documents",
            code=0,
            alone=False,
        ),
        Case(
            "a .json array of chats",
            [*inspect, "--data", str(chats_json)],
            "first: " + str(chats_json) + "[1]: unknown role 'wizard'",
            code=0,
            alone=False,
        ),
        Case(
            "a .json array of nothing usable",
            [*inspect, "--data", str(wizards)],
            "[0]: unknown role 'wizard'",
        ),
        Case(
            "a line of 200,000 nested brackets",
            [*inspect, "--data", str(deep)],
            "deep.jsonl:1: malformed JSON (nested too deeply to read)",
            code=0,
            alone=False,
        ),
        Case(
            "a lone surrogate escape",
            [*inspect, "--data", str(surrogate)],
            "surrogate.jsonl:1: malformed JSON (a \\u escape of half a surrogate pair",
            code=0,
            alone=False,
        ),
        # 4. damaged targets
        Case(
            "a target with a tensor missing",
            ["train", "--target", str(missing), *SMALL, *data, *new],
            "1 missing (model.layers.1.mlp.down_proj.weight)",
            alone=False,
            within_s=60,
        ),
        Case(
            "a target whose layer weights are NaN",
            ["train", "--target", str(nan), *SMALL, *data, *new, "--steps", "3"],
            "its hidden states are NaN or inf from layer 2 of 4",
            alone=False,
            within_s=60,
        ),
        Case(
            "a target folder without a tokenizer",
            ["train", "--target", str(bare), *SMALL, *data, *new],
            "has no usable tokenizer",
            within_s=60,
        ),
        Case(
            "a saved drafter as the target of train",
            ["train", "--target", str(done / "drafter"), *SMALL, *data, *new],
            "is a saved DFlash drafter",
            within_s=60,
        ),
        Case(
            "a saved drafter as the target of regenerate",
            [
                "regenerate",
                "--target",
                str(done / "drafter"),
                *data,
                "--output",
                str(work / "drafter-regen.jsonl"),
            ],
            "is a saved DFlash drafter",
            within_s=60,
        ),  # fmt: skip
    ]


def null_server() -> str:
    """An OpenAI-compatible endpoint (byte tokens, as builtin:tiny's) whose every
    completion is `"text": null`, served from this process while the cases run."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, body: dict) -> None:
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802 - the http.server hook name
            self._send({"data": [{"id": "builtin:tiny"}]})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                self._send({"tokens": list(body["content"].encode())})
                return
            self._send({"choices": [{"text": None, "finish_reason": "stop"}], "usage": {}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    null_server.keep = server  # type: ignore[attr-defined]  # serving while the cases run
    return f"http://127.0.0.1:{server.server_address[1]}"


def cut_regeneration(work: Path) -> Path:
    """A cache folder whose regeneration of the embedded default (builtin:tiny's) is cut
    in half: made once by a one-step run (about a minute), cut before every round."""
    cache = work / "regen-cache"
    made = sorted((cache / "regen").glob("embedded-*.jsonl"))
    if not made:
        first = run(["train", *SMALL[:2], "--steps", "1", "--output-dir", str(work / "regen-first"),
                     "--overwrite"], env={"DFLASH_CACHE_DIR": str(cache)})  # fmt: skip
        if first.returncode != 0:
            raise RuntimeError(first.stderr[-1000:])
        made = sorted((cache / "regen").glob("embedded-*.jsonl"))
    whole = made[0].read_bytes()
    made[0].write_bytes(whole[: len(whole) // 2])
    shutil.rmtree(work / "regen-run", ignore_errors=True)
    return cache


def damaged_targets(work: Path) -> tuple[Path, Path, Path]:
    """Copies of a tiny Qwen3 target: one tensor missing (and one unexpected), NaN in
    layer 2's weights, and no tokenizer files."""
    sys.path.insert(0, str(ROOT))
    import torch
    from safetensors.torch import load_file, save_file

    from tests.dflash.hf_fixtures import save_hf_target

    good = work / "qwen3-target"
    if not (good / "model.safetensors").exists():
        save_hf_target(good)
    missing, nan, bare = work / "missing-target", work / "nan-target", work / "bare-target"
    for copy in (missing, nan, bare):
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(good, copy)
    state = load_file(good / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    state["model.extra.weight"] = torch.zeros(2)
    save_file(state, str(missing / "model.safetensors"), metadata={"format": "pt"})
    state = load_file(good / "model.safetensors")
    for name, tensor in state.items():
        if name.startswith("model.layers.1.") and name.endswith("proj.weight"):
            tensor.fill_(float("nan"))
    save_file(state, str(nan / "model.safetensors"), metadata={"format": "pt"})
    for file in bare.iterdir():
        if file.name not in ("config.json", "generation_config.json", "model.safetensors"):
            file.unlink()
    return missing, nan, bare


def no_text(path: Path, text: str) -> Callable[[subprocess.Popen | None], list[str]]:
    def check(_: subprocess.Popen | None) -> list[str]:
        found = path.exists() and text in path.read_text()
        return [f"{path.name} holds {text!r}"] if found else []

    return check


def full_device(work: Path) -> Path:
    """A device whose writes fail with ENOSPC: a private twin of /dev/full where mknod is
    allowed (so that no run of older code can replace the system's), else /dev/full."""
    twin = work / "full"
    if not twin.exists():
        try:
            os.mknod(twin, stat.S_IFCHR | 0o666, os.makedev(1, 7))
        except OSError:
            return Path("/dev/full")
    return twin


def unchanged(path: Path, text: str) -> Callable[[subprocess.Popen | None], list[str]]:
    def check(_: subprocess.Popen | None) -> list[str]:
        return [] if path.read_text() == text else [f"{path.name} was replaced"]

    return check


def still_a_device(path: Path) -> Callable[[subprocess.Popen | None], list[str]]:
    def check(_: subprocess.Popen | None) -> list[str]:
        return [] if stat.S_ISCHR(os.stat(path).st_mode) else [f"{path} was replaced"]

    return check


def whole_lines(output: Path) -> Callable[[subprocess.Popen | None], list[str]]:
    def check(_: subprocess.Popen | None) -> list[str]:
        text = output.read_text() if output.exists() else ""
        return [] if text.endswith("\n") else ["a partial last line"]

    return check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="work in this folder and keep it")
    parser.add_argument(
        "--group",
        action="append",
        choices=list(GROUPS),
        help="run only this group of cases (repeatable; default: all of them)",
    )
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
    for leftover in (
        "new",
        "full-mid",
        "full-final",
        "unk",
        "from-cache",
        "held-cache",
        "held-export",
        "full-cache",
        "trace-full",
    ):
        shutil.rmtree(work / leftover, ignore_errors=True)
    for leftover in ("full.jsonl", "shared.jsonl", "null.jsonl", "drafter-regen.jsonl"):
        (work / leftover).unlink(missing_ok=True)
        (work / (leftover + ".run.json")).unlink(missing_ok=True)
    before = folder_state(done)
    good = counted = 0
    hub = silent_hub()
    all_cases = [case for group in args.group or GROUPS for case in GROUPS[group](work, hub)]
    for case in all_cases:
        if case.root_only and os.geteuid() != 0:
            print(f"skip {case.name:<44} (not root: permission bits already refuse it)")
            continue
        first = case.before() if case.before is not None else None
        started = time.monotonic()
        try:
            result = run(
                case.args, case.env, timeout=case.within_s + 60, program=case.program, cwd=case.cwd
            )
        except subprocess.TimeoutExpired:  # a hang: the case fails, the others still run
            result = subprocess.CompletedProcess(case.args, -9, "", "(killed: it hung)")
        took = time.monotonic() - started
        problems = judge(case, result, took)
        if case.check is not None:
            problems += case.check(first)
        if first is not None and first.poll() is None:
            first.kill()
            first.wait()
        if folder_state(done) != before:
            problems.append("the earlier run's folder changed")
            before = folder_state(done)
        good += not problems
        counted += 1
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        said = [
            line for line in (result.stdout + result.stderr).splitlines() if case.fragment in line
        ]
        shown = (errors or said or [result.stderr.strip()[-110:]])[0][:110]
        mark = "ok  " if not problems else "FAIL"
        print(f"{mark} {case.name:<44} {took:5.1f}s  {'; '.join(problems) or shown}", flush=True)
    print(f"{good} of {counted} bad-input cases: one line, the right exit code, "
          "no traceback, in time, the earlier run unchanged")  # fmt: skip
    return 0 if good == counted else 1


GROUPS: dict[str, Callable[[Path, str], list[Case]]] = {
    "first-rounds": lambda work, hub: cases(work),
    "ownership-cache-deadline": ownership_cache_and_deadline_cases,
    "unwritten-file-silent-server": unwritten_file_and_silent_server_cases,
    "lying-data-damaged-target": lambda work, hub: lying_data_and_damaged_target_cases(work),
}
"""The groups of cases (`--group`), each built (its files prepared) only when it runs."""


def judge(case: Case, result: subprocess.CompletedProcess, took: float) -> list[str]:
    """What is wrong with how a case ended: an error case ends with its `Error:` line
    alone on standard error (`alone`; work that ran first may print before it), a good
    case with its line."""
    problems = []
    if result.returncode != case.code:
        problems.append(f"exit {result.returncode}, not {case.code}")
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    if case.code == 0:
        if errors:
            problems.append(f"{len(errors)} Error: lines")
        if case.fragment not in result.stdout + result.stderr:
            problems.append(f"no {case.fragment!r} in the output")
    elif len(errors) != 1:
        problems.append(f"{len(errors)} Error: lines")
    elif case.fragment not in errors[0]:
        problems.append(f"no {case.fragment!r} in the line")
    elif case.alone and result.stderr.strip().splitlines() != errors:
        problems.append(f"{len(result.stderr.strip().splitlines()) - 1} lines besides the Error:")
    if "Traceback" in result.stderr:
        problems.append("a traceback")
    if took > case.within_s:
        problems.append(f"{took:.1f} s")
    return problems


if __name__ == "__main__":
    sys.exit(main())
