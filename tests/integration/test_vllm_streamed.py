"""`train --target-engine vllm`: SmolLM2-135M-Instruct's hidden states streamed from vLLM's
CPU build through a bounded spool give the losses of the same steps trained from the
files the same extraction script writes; the spool stays within its bound while the
run's states are more than 10x it; no process of vLLM outlives the run, whether it ends
well, by SIGTERM, or by the engine dying; under torchrun each rank streams its own rows.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, die_with_parent
from test_vllm_hidden_states import _chats
from vllm_fixtures import (  # noqa: F401 - fixtures
    dflash_ok,
    end_leftovers,
    new_marker,
    smollm2_dir_fixture,
    vllm_env,
    vllm_python_fixture,
)

from dflash.config.settings import config_from_options
from dflash.offline.spool import spool_bytes
from dflash.run.rows import rows_before_target
from dflash.run.streamed import stream_plan
from dflash.run.target_features import live_target

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.vllm]

SCRIPT = REPO_ROOT / "tools" / "vllm" / "extract_hidden_states.py"
STEPS = 16
# One sample of --seq-len 128 is 128 x 3 layers x 576 x 4 bytes = 0.88 MB; the bound
# takes two, and the run's 16 steps of 2 rows read more than 10 times it.
SPOOL_SIZE = 2_000_000
DATA_OPTIONS = (
    "--seq-len 128 --batch-size 2 --drafter-layers 2 --seed 0 --packing docs --precision fp32"
).split()
TRAIN_OPTIONS = (
    f"--block-size 4 --num-anchors 8 --steps {STEPS} --log-every 1 --eval-prompts 0 --overwrite"
).split()


def _train(args: list[str], marker: str, timeout_s: float = 600) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dflash.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=vllm_env(marker),
        preexec_fn=die_with_parent,
    )


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


class _Watch:
    """The spool's bytes, polled from outside both processes."""

    def __init__(self, spool: Path) -> None:
        self.spool, self.peak, self._stop = spool, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, spool_bytes(self.spool))
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def test_streamed_losses_equal_the_files_and_the_spool_stays_bounded(
    vllm_python: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    data = ["--target", str(smollm2_dir), "--data", str(_chats(tmp_path / "chats.jsonl"))]
    data += DATA_OPTIONS
    # From files: the samples, vLLM's states of them, training from the files.
    files = tmp_path / "files"
    dflash_ok(
        "cache-hidden", "--format", "speculators", "--samples-only", "--output", str(files), *data
    )
    marker = new_marker()
    started = time.perf_counter()
    done = subprocess.run(
        [str(vllm_python), str(SCRIPT), "--target", str(smollm2_dir)]
        + ["--samples", str(files / "samples.jsonl"), "--output", str(files)],
        capture_output=True,
        text=True,
        timeout=600,
        env=vllm_env(marker),
        check=False,
        preexec_fn=die_with_parent,
    )
    extract_s = time.perf_counter() - started
    assert not end_leftovers(marker)
    assert done.returncode == 0, done.stderr[-3000:]
    cached = tmp_path / "cached"
    dflash_ok(
        "train", *data, *TRAIN_OPTIONS, "--hidden-cache", str(files), "--output-dir", str(cached)
    )
    # Streamed.
    run = tmp_path / "streamed"
    spool = tmp_path / "spool"
    marker = new_marker()
    started = time.perf_counter()
    proc = _train(
        [*data, *TRAIN_OPTIONS, "--output-dir", str(run), "--target-engine", "vllm"]
        + ["--vllm-python", str(vllm_python), "--spool-dir", str(spool)]
        + ["--spool-size", str(SPOOL_SIZE)],
        marker,
    )
    watch = _Watch(spool)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        peak = watch.stop()
        left = end_leftovers(marker)
    streamed_s = time.perf_counter() - started
    assert proc.returncode == 0, err[-3000:] + (run / "vllm-extract.log").read_text()[-3000:]
    assert not left, f"processes {left} of vLLM outlived the streamed run"
    summary = json.loads((run / "summary.json").read_text())
    states = summary["spool_bytes_read"]
    figures = (
        f"spool peak {peak:,} B polled, {summary['spool_peak_bytes']:,} B at reads, bound "
        f"{SPOOL_SIZE:,} B; states read {states:,} B ({states / SPOOL_SIZE:.1f}x); "
        f"{summary['spool_samples_read']} samples; extraction then training from files "
        f"{extract_s:.0f} s + training, streamed {streamed_s:.0f} s"
    )
    print(figures)
    assert 0 < peak <= SPOOL_SIZE and summary["spool_peak_bytes"] <= SPOOL_SIZE, figures
    assert states >= 10 * SPOOL_SIZE, figures
    streamed, from_files = _losses(run), _losses(cached)
    assert len(streamed) == len(from_files) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(streamed, from_files, strict=True))
    print(
        f"losses: streamed {streamed[:3]}..., from files {from_files[:3]}...; max rel {worst:.3g}"
    )
    assert streamed == from_files, f"max rel {worst:.3g}"


def _engine_pid(run: Path) -> int:
    """The pid (and process group) of the extraction script `run`'s engine runs."""
    return next(
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and str(SCRIPT).encode() in (p / "cmdline").read_bytes()
        and f"{run}".encode() in (p / "cmdline").read_bytes()
    )


def test_sigterm_and_a_dead_engine_leave_no_vllm_process(
    vllm_python: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    data = ["--target", str(smollm2_dir), "--data", str(_chats(tmp_path / "chats.jsonl"))]
    base = [*data, *DATA_OPTIONS, "--block-size", "4", "--num-anchors", "8", "--eval-prompts", "0"]
    base += ["--target-engine", "vllm", "--vllm-python", str(vllm_python)]
    base += ["--spool-size", str(SPOOL_SIZE), "--steps", "1000", "--save-every", "1"]

    def started(run: Path, marker: str) -> subprocess.Popen[str]:
        proc = _train([*base, "--output-dir", str(run)], marker)
        deadline = time.monotonic() + 400
        while not any(run.glob("checkpoints/step-*")):  # a step trained, and saved
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint in 400 s"
            time.sleep(0.5)
        return proc

    # SIGTERM to the trainer, mid-run.
    marker = new_marker()
    proc = started(tmp_path / "term", marker)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        left = end_leftovers(marker)
    assert proc.returncode == 143, err[-2000:]
    assert not left, f"processes {left} of vLLM outlived a SIGTERM to the run"
    # The engine dies mid-run (its whole group, as the OOM killer could): one line naming
    # its log, a checkpoint kept, exit non-zero.
    marker = new_marker()
    run = tmp_path / "dead"
    proc = started(run, marker)
    try:
        os.killpg(_engine_pid(run), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        left = end_leftovers(marker)
    assert proc.returncode not in (0, None), err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "vllm-extract.log" in errors[0], err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept and kept[-1].startswith("step-"), kept  # the last one, kept
    print(f"dead engine: {errors[0]}; checkpoints {kept}")
    assert not left, f"processes {left} of vLLM outlived the dead engine's run"


RESUME_STEPS = 12


def _sample(line: dict) -> dict[str, int]:
    return {k: line[k] for k in ("batch", "slot", "row", "start")} | {
        "tokens": len(line["token_ids"])
    }


def _plan(run: Path, name: str = "vllm-samples.jsonl") -> list[dict[str, int]]:
    """The run's plan, one (batch, slot, row, start, tokens) per sample, in reading order
    (a row may fill two slots of a batch where epochs meet)."""
    return [_sample(json.loads(line)) for line in (run / name).read_text().splitlines()]


def test_a_killed_engine_resumes_at_the_next_batch_and_trains_each_row_once(
    vllm_python: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    data = ["--target", str(smollm2_dir), "--data", str(_chats(tmp_path / "chats.jsonl"))]
    run, spool = tmp_path / "run", tmp_path / "spool"
    base = [*data, *DATA_OPTIONS, "--block-size", "4", "--num-anchors", "8", "--eval-prompts", "0"]
    base += ["--target-engine", "vllm", "--vllm-python", str(vllm_python)]
    base += ["--spool-size", str(SPOOL_SIZE), "--spool-dir", str(spool)]
    base += ["--steps", str(RESUME_STEPS), "--save-every", "1", "--log-every", "1"]
    base += ["--output-dir", str(run)]
    # The first run: its engine's whole group killed once two steps are saved.
    marker = new_marker()
    proc = _train(base, marker)
    try:
        deadline = time.monotonic() + 400
        # Earlier checkpoints are rotated out: any of step 2 or later.
        while not any(int(p.name[5:]) >= 2 for p in run.glob("checkpoints/step-*")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no second checkpoint in 400 s"
            time.sleep(0.1)
        os.killpg(_engine_pid(run), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        left = end_leftovers(marker)
    assert not left, f"processes {left} of vLLM outlived the killed engine's run"
    assert proc.returncode not in (0, None), err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    saved = sorted(int(p.name.removeprefix("step-")) for p in run.glob("checkpoints/step-*"))
    stopped = saved[-1]
    assert 2 <= stopped < RESUME_STEPS, saved
    first_plan = _plan(run)
    # The second run resumes from the last checkpoint: its engine starts at the batch
    # that checkpoint needs next.
    marker = new_marker()
    traces = tmp_path / "traces.jsonl"
    proc = _train([*base, "--resume", "latest", "--trace-file", str(traces)], marker)
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        left = end_leftovers(marker)
    assert proc.returncode == 0, err[-3000:] + (run / "vllm-extract.log").read_text()[-3000:]
    assert not left, f"processes {left} of vLLM outlived the resumed run"
    second_plan = _plan(run)
    summary = json.loads((run / "summary.json").read_text())
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Every step once; batch i is step i + 1's (one drafter).
    assert steps == list(range(1, RESUME_STEPS + 1)), steps
    assert {s["batch"] for s in first_plan} == set(range(RESUME_STEPS)), first_plan
    assert second_plan and min(s["batch"] for s in second_plan) == stopped, second_plan
    # The samples trained: the first run's batches up to its checkpoint, the second
    # run's, every one it read (its summary counts the files it took from the spool).
    trained = [s for s in first_plan if s["batch"] < stopped] + second_plan
    assert summary["spool_samples_read"] == len(second_plan), (summary, len(second_plan))
    keys = [(s["batch"], s["slot"], s["start"]) for s in trained]
    repeated = {k for k in keys if keys.count(k) > 1}
    assert not repeated, f"samples trained twice: {sorted(repeated)}"
    assert sorted(trained, key=str) == sorted(first_plan, key=str), "a sample skipped or altered"
    # The engine in the trace: one engine.sample per sample read, each under the
    # target.read that took it; and a wait on the engine is never called a disk's.
    spans = [
        span
        for line in traces.read_text().splitlines()
        for resource in json.loads(line)["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]
    reads = {span["spanId"] for span in spans if span["name"] == "target.read"}
    engine = [span for span in spans if span["name"] == "engine.sample"]
    assert len(engine) == len(second_plan), (len(engine), len(second_plan))
    assert all(span["parentSpanId"] in reads for span in engine)
    assert "reader-bound" not in err, err[-3000:]
    verdicts = [line for line in err.splitlines() if line.startswith("verdict:")]
    print(
        f"killed after step {stopped} (checkpoints {saved}); trained {len(trained)} samples "
        f"of {RESUME_STEPS} batches once each: {len(trained) - len(second_plan)} before the "
        f"kill, {len(second_plan)} after the resume; {len(engine)} engine.sample spans; "
        f"{verdicts[-1:]}"
    )


def test_a_target_the_engine_cannot_load_is_one_line_naming_why(
    vllm_python: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    # The trainer loads the target's embedding and head from this folder; vLLM picks its
    # model class by `architectures`, and knows none of this name.
    target = tmp_path / "target"
    target.mkdir()
    for part in smollm2_dir.iterdir():
        (target / part.name).symlink_to(part)
    config = json.loads((smollm2_dir / "config.json").read_text())
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps(config | {"architectures": ["NoSuchLM"]}))
    data = ["--target", str(target), "--data", str(_chats(tmp_path / "chats.jsonl"))]
    run = tmp_path / "run"
    marker = new_marker()
    proc = _train(
        [*data, *DATA_OPTIONS, *TRAIN_OPTIONS, "--output-dir", str(run)]
        + ["--target-engine", "vllm", "--vllm-python", str(vllm_python)],
        marker,
    )
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        left = end_leftovers(marker)
    assert not left, f"processes {left} of vLLM outlived the run"
    assert proc.returncode not in (0, None), err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    # The engine's own reason, not only its exit code and a log to search.
    assert "the vLLM engine exited with code 1 (" in errors[0], errors[0]
    assert "NoSuchLM" in errors[0] and "vllm-extract.log" in errors[0], errors[0]
    print(f"a target vLLM cannot load: {errors[0]}")


TORCHRUN_STEPS = 3


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_ranks_stream_disjoint_rows_that_together_are_the_plan(
    vllm_python: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    # Two gloo ranks, an engine each over its own batches, each in its folder of one
    # --spool-dir; as small as two CPU engines on this machine allow.
    data = ["--target", str(smollm2_dir), "--data", str(_chats(tmp_path / "chats.jsonl"))]
    options = DATA_OPTIONS[:]
    options[options.index("--seq-len") + 1] = "64"
    run, spool = tmp_path / "run", tmp_path / "spool"
    args = [*data, *options, "--block-size", "4", "--num-anchors", "8", "--eval-prompts", "0"]
    args += ["--target-engine", "vllm", "--vllm-python", str(vllm_python)]
    args += ["--spool-size", str(SPOOL_SIZE), "--spool-dir", str(spool)]
    args += ["--steps", str(TORCHRUN_STEPS), "--log-every", "1", "--output-dir", str(run)]
    marker = new_marker()
    env = vllm_env(marker) | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        ["torchrun", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "dflash.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=die_with_parent,
    )
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        left = end_leftovers(marker)
    logs = "".join(p.read_text()[-2000:] for p in sorted(run.glob("vllm-extract.rank-*.log")))
    assert proc.returncode == 0, out[-4000:] + logs
    assert not left, f"processes {left} of vLLM outlived the torchrun run"
    plans = [_plan(run, f"vllm-samples.rank-{r:05d}.jsonl") for r in range(2)]
    # Rank r reads batches r, r+2, ...: its plan holds those alone.
    batches = [sorted({s["batch"] for s in plan}) for plan in plans]
    assert batches == [[0, 2, 4], [1, 3, 5]], batches
    keys = [{(s["batch"], s["slot"], s["start"]) for s in plan} for plan in plans]
    assert not keys[0] & keys[1], "a sample in both ranks' plans"
    # Together they are the plan of one process over batches 0..5, sample for sample.
    cfg = config_from_options(
        {
            "target": str(smollm2_dir),
            "data": str(tmp_path / "chats.jsonl"),
            "seq_len": 64,
            "batch_size": 2,
            "drafter_layers": 2,
            "seed": 0,
            "packing": "docs",
            "precision": "fp32",
            "output_dir": str(tmp_path / "plan"),
        }
    )
    rows = rows_before_target(cfg, live_target(cfg), log=lambda _: None)
    assert rows is not None
    _, lines = stream_plan(rows.train, 0, 2 * TORCHRUN_STEPS - 1)
    whole = [_sample(json.loads(line)) for line in lines]
    together = plans[0] + plans[1]
    assert sorted(together, key=str) == sorted(whole, key=str), "a sample skipped or altered"
    # Each rank read its every sample: what it read is deleted, and nothing is left.
    assert [spool_bytes(spool / f"rank-{r:05d}") for r in range(2)] == [0, 0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["pipeline"]["world_size"] == 2 and summary["steps"] == TORCHRUN_STEPS
    assert summary["spool_samples_read"] == len(plans[0]), (summary, len(plans[0]))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, TORCHRUN_STEPS + 1)), steps
    print(
        f"torchrun x2: rank 0 read {len(plans[0])} samples of batches {batches[0]}, rank 1 "
        f"{len(plans[1])} of {batches[1]}; together the {len(whole)} of one process's plan"
    )
