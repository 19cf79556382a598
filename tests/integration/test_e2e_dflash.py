"""End to end: `dflash-train train` exports its phase spans to the real Jaeger.

Each run trains a few steps of the embedded default on the CPU, exporting over OTLP
gRPC or HTTP (and writing a --trace-file), then reads Jaeger's query API: the service
is listed, the operations include every phase, and each batch trace is the whole tree
of docs/design.md §5 with its attributes. The last test stops Jaeger mid-run, waits and
restarts it: training goes on, spans after the return arrive, and the final summary
counts what was lost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, JaegerProcess
from spantree import (
    PHASES,
    batch_tree_problems,
    find_root,
    merge_otlp_json_lines,
    root_of,
    service_of,
    spans_by_name,
    tags,
)

from dflash import names

pytestmark = pytest.mark.slow

STEPS = 6
RUN_TIMEOUT_S = 420
# Small and fast: the point is the spans, not the drafter.
FAST_FLAGS = (
    "--batch-size",
    "2",
    "--seq-len",
    "64",
    "--eval-prompts",
    "1",
    "--eval-new-tokens",
    "8",
)
# Attribute keys on the spans, by meaning; the first one present is used.
STEP_KEYS = (names.STEP,)
BATCH_ID_KEYS = (names.BATCH_ID,)
TOKENS_KEYS = (names.TOKENS,)
DEVICE_KEYS = (names.DEVICE,)


def dflash_train() -> list[str]:
    """`dflash-train` of this checkout, whatever the environment's console script points at."""
    return [sys.executable, "-m", "dflash.cli"]


def checkout_env(**extra: str) -> dict[str, str]:
    """The environment of a `dflash_train()` process: this checkout first on the path."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="module", autouse=True)
def _train_help_runs() -> None:
    """`train --help` of this checkout starts and lists the tracing flags. A crash there
    fails every test of the module with its output (it used to skip them all)."""
    done = subprocess.run(
        [*dflash_train(), "train", "--help"],
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--otlp-endpoint" in done.stdout, done.stdout[-3000:]


def train(tmp_path: Path, service: str, *extra: str, steps: int = STEPS) -> subprocess.Popen[str]:
    """Starts `dflash-train train` in the background; output goes to tmp_path/train.log."""
    env = checkout_env(OTEL_SERVICE_NAME=service)
    log = (tmp_path / "train.log").open("w")
    return subprocess.Popen(
        [
            *dflash_train(),
            "train",
            "--steps",
            str(steps),
            "--output-dir",
            str(tmp_path / "run"),
            *FAST_FLAGS,
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def finish(process: subprocess.Popen[str], tmp_path: Path, returncode: int = 0) -> str:
    try:
        process.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = (tmp_path / "train.log").read_text()
    assert process.returncode == returncode, f"dflash-train exit code:\n{output[-4000:]}"
    return output


def first_tag(span_tags: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in span_tags:
            return span_tags[key]
    raise AssertionError(f"none of {keys} among the span's attributes {sorted(span_tags)}")


def batch_traces(traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Checkpoint and evaluation spans form traces of their own; keep the batches.
    return [t for t in traces if (find_root(t) or {}).get("operationName") == "batch"]


def assert_batch_traces(traces: list[dict[str, Any]], service: str, steps: int) -> None:
    batches = batch_traces(traces)
    assert len(batches) == steps, f"{len(batches)} batch traces for {steps} steps"
    seen_steps, seen_batches = [], set()
    for found in batches:
        assert batch_tree_problems(found) == [], found["traceID"]
        root = root_of(found)
        assert service_of(found, root) == service
        by_name = spans_by_name(found)
        root_tags = tags(root)
        # The step is known once the drafter takes the batch; either span may carry it.
        step_tags = {**root_tags, **tags(by_name["drafter.step"][0])}
        seen_steps.append(int(first_tag(step_tags, STEP_KEYS)))
        seen_batches.add(first_tag(root_tags, BATCH_ID_KEYS))
        assert int(first_tag(root_tags, TOKENS_KEYS)) > 0
        for name in ("target.forward", "drafter.step"):
            assert first_tag(tags(by_name[name][0]), DEVICE_KEYS) == "cpu", name
    assert sorted(seen_steps) == list(range(steps))
    assert len(seen_batches) == steps


def wait_for_batches(jaeger: JaegerProcess, service: str, count: int) -> list[dict[str, Any]]:
    return jaeger.wait_for(
        lambda: jaeger.traces(service),
        lambda found: (
            len(batch_traces(found)) >= count
            and all(len(t["spans"]) >= len(PHASES) for t in batch_traces(found))
        ),
        timeout_s=60,
        waiting_for=f"{count} complete batch traces of {service}",
    )


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_training_exports_whole_batch_trees(
    jaeger: JaegerProcess, tmp_path: Path, protocol: str
) -> None:
    service = f"dflash-train-e2e-{protocol}-{uuid.uuid4().hex[:6]}"
    endpoint = jaeger.otlp_grpc_endpoint if protocol == "grpc" else jaeger.otlp_http_endpoint
    trace_file = tmp_path / "spans.jsonl"
    process = train(
        tmp_path,
        service,
        "--otlp-endpoint",
        endpoint,
        "--otlp-protocol",
        protocol,
        "--trace-file",
        str(trace_file),
    )
    finish(process, tmp_path)

    assert service in jaeger.wait_for(
        jaeger.services,
        lambda found: service in found,
        waiting_for=f"service {service} (does `train` export to --otlp-endpoint?)",
    )
    operations = jaeger.wait_for(
        lambda: jaeger.operations(service), lambda found: set(PHASES) <= set(found)
    )
    assert set(PHASES) <= set(operations)
    exported = wait_for_batches(jaeger, service, STEPS)
    assert_batch_traces(exported, service, STEPS)

    # The trace file of the same run, through Jaeger's OTLP->Jaeger transform, is the
    # same set of trees (same trace ids, same spans).
    from_file = jaeger.transform(merge_otlp_json_lines(trace_file))
    assert_batch_traces(from_file, service, STEPS)
    span_ids = {t["traceID"]: {s["spanID"] for s in t["spans"]} for t in batch_traces(exported)}
    assert {t["traceID"]: {s["spanID"] for s in t["spans"]} for t in batch_traces(from_file)} == (
        span_ids
    )


SUMMARY_RE = re.compile(r"spans exported \d+, failed (\d+), dropped (\d+)")
DRAFTER_RATE_RE = re.compile(r"throughput: .*?drafter ([\d,.]+) tok/s")


def interval_drafter_rates(output: str) -> list[float]:
    """Drafter tokens/s of each interval table (the final cumulative one excluded)."""
    intervals = output.split("interval: total")[0].split("interval: last")[1:]
    found = (DRAFTER_RATE_RE.search(block) for block in intervals)
    return [float(m[1].replace(",", "")) for m in found if m]


def test_collector_outage_loses_spans_but_not_training(
    own_jaeger: JaegerProcess, tmp_path: Path
) -> None:
    service = f"dflash-train-outage-{uuid.uuid4().hex[:6]}"
    # Far more steps than the test lasts: SIGTERM ends the run (checkpoint + summary).
    otlp = ["--otlp-endpoint", own_jaeger.otlp_grpc_endpoint, "--otlp-protocol", "grpc"]
    process = train(tmp_path, service, *otlp, "--profile-interval", "2", steps=1_000_000)
    try:
        wait_for_batches(own_jaeger, service, 2)  # training runs and exports
        own_jaeger.stop()
        stopped_at_us = time.time_ns() // 1000
        time.sleep(5.0)
        assert process.poll() is None, "training ended during the outage"
        own_jaeger.start()
        back_at_us = time.time_ns() // 1000

        # Traces cut by the outage may arrive in part, and so may the first ones after the
        # return: the exporter's channel may still be in its reconnect backoff, and while
        # the spans queued during the outage drain, a full queue drops new ones. Once a
        # whole trace has arrived and the backlog had time to drain, every trace is whole.
        def whole_since_back() -> list[dict[str, Any]]:
            traces = batch_traces(own_jaeger.traces(service))
            later = [t for t in traces if root_of(t)["startTime"] > back_at_us]
            return [t for t in later if not batch_tree_problems(t)]

        first_whole = own_jaeger.wait_for(
            whole_since_back,
            bool,
            timeout_s=60,
            waiting_for="a whole batch trace begun after Jaeger came back",
        )
        drained_s = 2.0  # the queued spans (at most the queue's 8192) are sent by then
        recovered_at_us = min(root_of(t)["startTime"] for t in first_whole) + int(drained_s * 1e6)
        time.sleep(6.0)  # interval tables after the return, and a window of whole traces
        settled_before_us = time.time_ns() // 1000 - 2_000_000  # exported and stored by now
        assert process.poll() is None, "training ended while Jaeger came back"
        window = own_jaeger.traces(
            service, limit=5000, start=recovered_at_us, end=settled_before_us
        )
        started = [(root_of(t)["startTime"], t) for t in batch_traces(window)]
        after = [t for start, t in started if recovered_at_us <= start < settled_before_us]
        process.send_signal(signal.SIGTERM)
    finally:
        output = finish(process, tmp_path, returncode=143)  # kills it if still running
    assert len(after) >= 2
    for found in after:
        assert batch_tree_problems(found) == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] == "SIGTERM" and summary["steps"] > 2
    # Batches that ran while Jaeger was away never reach it; the summary counts them.
    match = SUMMARY_RE.search(output)
    assert match, f"no failed/dropped summary in the output:\n{output[-3000:]}"
    assert int(match[1]) + int(match[2]) > 0, match[0]
    lost = summary["telemetry"]["spans_dropped"] + summary["telemetry"]["spans_not_delivered"]
    assert lost > 0
    # Full speed throughout: no interval (2 s each, the outage spans two or more) trains
    # much slower than the typical one; a blocking exporter would stall them to zero.
    rates = interval_drafter_rates(output)[1:-1]  # the first and last are partial
    assert len(rates) >= 4, output[-3000:]
    assert min(rates) >= 0.6 * statistics.median(rates), rates
    assert stopped_at_us < back_at_us
