"""Tracing the pipeline end to end: real runs into the SDK's in-memory exporter.

Run under torchrun this file is also the worker of the two-rank telemetry test:
`torchrun --nproc-per-node 2 tests/dflash/observe/test_observer.py OUT_DIR`.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import tracing
from dflash import names
from dflash.observe.observer import Observer, describe, setup_tracing, tracing_config
from dflash.pipeline.queues import PipelineError
from dflash.pipeline.stages import Pipeline
from dflash.run.pipelined import run_pipeline
from dflash.signals import TrainingInterrupted
from dflash.train.step import DrafterTrainer, null_phase
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    script_env,
    small_cfg,
    small_target_everywhere,
    tiny_target,
    torchrun_command,
)

STEPS = 4
PARENT = {
    names.DATA_BATCH: names.BATCH,
    names.BATCH_QUEUE_WAIT: names.BATCH,
    names.TARGET_FORWARD: names.BATCH,
    names.HS_QUEUE_PUT: names.BATCH,  # the target thread handing the states over
    names.HS_QUEUE_WAIT: names.BATCH,
    names.DRAFTER_STEP: names.BATCH,
    **{p: names.DRAFTER_STEP for p in names.DRAFTER_PHASES},
}


def observer(sample_ratio: float = 1.0, output_dir=None) -> tuple[Observer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    cfg = tracing.TracingConfig(
        sample_ratio=sample_ratio, report_interval_s=60, attribute_namespace="dflash"
    )
    telemetry = setup_tracing(cfg, span_processors=[SimpleSpanProcessor(exporter)])
    return Observer(cfg, telemetry, world_size=1, output_dir=output_dir), exporter


def traced_run(tmp_path, obs: Observer, **overrides) -> list[str]:
    lines: list[str] = []
    cfg = small_cfg(tmp_path, steps=STEPS, **overrides)
    try:
        run_pipeline(cfg, log=lines.append, observer=obs)
    finally:
        obs.close(lines.append)
    return lines


def batch_trees(spans):
    roots = [s for s in spans if s.name == "batch"]
    return {
        r.context.trace_id: [s for s in spans if s.context.trace_id == r.context.trace_id]
        for r in roots
    }


@pytest.mark.usefixtures("tiny_target")
def test_replicas_combine_gradients_in_a_phase_of_their_own(tmp_path) -> None:
    """drafter.grad_sync follows drafter.backward under drafter.step: a replica waiting
    for the others (.wait) apart from the reduction (.reduce, with bytes and world size),
    so a slow replica no longer looks like a slow backward."""
    obs, exporter = observer()
    traced_run(tmp_path, obs, drafter_devices=("cpu", "cpu"))
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    def parent(span) -> str:
        return by_id[span.parent.span_id].name

    syncs = [s for s in spans if s.name == names.GRAD_SYNC]
    assert len(syncs) == 2 * STEPS and {parent(s) for s in syncs} == {names.DRAFTER_STEP}
    waits = [s for s in spans if s.name == names.GRAD_SYNC_WAIT]
    reduces = [s for s in spans if s.name == names.GRAD_SYNC_REDUCE]
    assert len(waits) == 2 * 2 * STEPS and len(reduces) == STEPS  # replica 0 reduces
    assert {parent(s) for s in waits + reduces} == {names.GRAD_SYNC}
    attributes = reduces[0].attributes
    assert attributes[names.GRAD_BYTES] > 0 and attributes[names.WORLD_SIZE] == 1
    for step in (s for s in spans if s.name == names.DRAFTER_STEP):
        children = sorted(
            (s for s in spans if s.parent is not None and s.parent.span_id == step.context.span_id),
            key=lambda s: s.start_time,
        )
        order = [c.name for c in children]
        assert (
            order.index(names.BACKWARD)
            < order.index(names.GRAD_SYNC)
            < order.index(names.OPTIMIZER)
        )


@pytest.mark.usefixtures("tiny_target")
def test_every_batch_has_a_whole_tree_in_time_order(tmp_path) -> None:
    obs, exporter = observer()
    lines = traced_run(tmp_path, obs)
    spans = exporter.get_finished_spans()
    trees = batch_trees(spans)
    assert len(trees) == STEPS
    for trace in trees.values():
        by_id = {s.context.span_id: s for s in trace}
        named = {s.name: s for s in trace}
        assert sorted(named) == sorted(["batch", *PARENT]), sorted(named)
        for name, parent in PARENT.items():
            child = named[name]
            assert by_id[child.parent.span_id].name == parent, name
            assert by_id[child.parent.span_id].start_time <= child.start_time, name
            assert child.end_time <= by_id[child.parent.span_id].end_time, name
        # A wait ends before the phase it waited for starts.
        assert named["batch_queue.wait"].end_time <= named["target.forward"].start_time
        assert named["hs_queue.wait"].end_time <= named["drafter.step"].start_time
        assert named["target.forward"].end_time <= named["hs_queue.wait"].end_time
        assert named["target.forward"].end_time <= named["hs_queue.put"].start_time
        assert named["batch"].attributes[names.STEP] == named["drafter.step"].attributes[names.STEP]
        root = named["batch"].attributes
        assert root[names.TOKENS] > 0 and names.BATCH_ID in root and root[names.RANK] == 0
        step_attrs = named["drafter.step"].attributes
        assert step_attrs[names.DEVICE] == "cpu" and names.STEP in step_attrs
        assert step_attrs[names.THREAD_NAME] == "drafter-0" and names.THREAD_ID in step_attrs
        assert names.QUEUE_DEPTH in named["hs_queue.wait"].attributes
        assert set(named) <= set(names.SPANS)
    steps = sorted(named_step(t) for t in trees.values())
    assert steps == list(range(STEPS))
    # Logged steps (the first and the last here) carry the step figures.
    logged = {
        named_step(t): t for t in trees.values() if names.METRIC_LOSS in step_span(t).attributes
    }
    assert sorted(logged) == [0, STEPS - 1]
    attrs = step_span(logged[0]).attributes
    assert attrs[names.METRIC_LOSS] > 0 and attrs[names.METRIC_TAU_ESTIMATE] >= 1.0
    lines_on_disk = (tmp_path / "metrics.jsonl").read_text().splitlines()
    jsonl = [json.loads(line) for line in lines_on_disk]
    assert [m["step"] for m in jsonl] == [1, STEPS]
    assert jsonl[0]["loss"] == attrs[names.METRIC_LOSS]
    # Checkpoint saves and evaluation are traces of their own.
    assert {"checkpoint.save", "eval"} <= {s.name for s in spans if s.parent is None}
    assert any(line.startswith("telemetry: traces -> nowhere") for line in lines)
    assert any("spans exported" in line for line in lines)


def step_span(trace):
    return next(s for s in trace if s.name == names.DRAFTER_STEP)


def named_step(trace) -> int:
    return step_span(trace).attributes[names.STEP]


@pytest.mark.usefixtures("tiny_target")
def test_failing_drafter_step_marks_its_spans_and_prints_the_final_table(
    tmp_path, monkeypatch, capsys
) -> None:
    real_step = DrafterTrainer.step

    def step(self, batch, target_out, phase=null_phase):
        if batch.batch_id == 2:
            with phase("drafter.loss"):
                raise FloatingPointError("loss is nan")
        return real_step(self, batch, target_out, phase)

    monkeypatch.setattr(DrafterTrainer, "step", step)
    obs, exporter = observer()
    with pytest.raises(PipelineError) as failure:
        traced_run(tmp_path, obs)
    assert "drafter-0" in str(failure.value) and "drafter.loss" in str(failure.value)
    assert "FloatingPointError: loss is nan" in str(failure.value)
    err = capsys.readouterr().err
    assert "interval: total" in err and "drafter.loss" in err
    failed = {
        s.name: s for s in exporter.get_finished_spans() if s.status.status_code == StatusCode.ERROR
    }
    assert {"drafter.loss", "drafter.step", "batch"} <= set(failed)
    assert any(e.name == "exception" for e in failed["drafter.loss"].events)


def synthetic_step(batch, target_out, phase) -> float:
    with phase("drafter.loss"):
        return 0.0


def synthetic_run(obs: Observer, batches: int) -> None:
    pipe = Pipeline.build(
        make_batch=lambda i: type("B", (), {"batch_id": i, "num_tokens": 8})(),
        indices=range(batches),
        forwards=[("cpu", lambda b: b)],
        steps=[("cpu", synthetic_step, None)],
        on_step=lambda *_: None,
        batch_queue_size=4,
        hs_queue_size=4,
    )
    pipe.run()
    pipe.raise_if_failed()


def test_sampling_exports_a_tenth_but_counts_every_phase() -> None:
    counts = {}
    exported = {}
    for ratio in (1.0, 0.1):
        obs, exporter = observer(sample_ratio=ratio)
        synthetic_run(obs, 400)
        counts[ratio] = {n: p.count for n, p in obs.stats.snapshot().phases.items()}
        obs.close(lambda _: None)
        exported[ratio] = sum(s.name == "batch" for s in exporter.get_finished_spans())
    assert counts[0.1] == counts[1.0]
    # One wait per batch, and the drafter's last wait, which ends in end-of-stream.
    assert counts[1.0]["hs_queue.wait"] == 400 + 1
    assert exported[1.0] == 400
    assert 10 <= exported[0.1] <= 80  # binomial(400, 0.1): mean 40, sd 6


def test_flags_win_over_otel_variables_and_the_line_says_what_is_in_force(monkeypatch) -> None:
    import torch

    from dflash.config.settings import TelemetryConfig

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    cfg = tracing_config(TelemetryConfig(), rank=1, run_id="r")
    telemetry = setup_tracing(cfg)
    line = describe(cfg, telemetry)
    telemetry.shutdown(timeout_s=0.5)
    assert "traces -> OTLP/grpc http://127.0.0.1:9" in line and "service from-env" in line
    flags = TelemetryConfig(
        otlp_endpoint="http://127.0.0.1:8",
        otlp_protocol="http",
        service_name="flag",
        trace_sample_ratio=0.5,
        cuda_timing="events",
    )
    cfg = tracing_config(flags, rank=1, run_id="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no CUDA here: one warning, then off
        telemetry = setup_tracing(cfg)
    line = describe(cfg, telemetry)
    telemetry.shutdown(timeout_s=0.5)
    resource = telemetry.resource.attributes
    assert "OTLP/http/protobuf http://127.0.0.1:8" in line and "sample ratio 0.5" in line
    assert "service flag" in line and resource["service.instance.id"] in line
    assert resource["service.version"] and resource["dflash.rank"] == 1
    # The timing in force, not the one asked for: off after the fallback without CUDA.
    assert f"cuda timing {'events' if torch.cuda.is_available() else 'off'};" in line


def test_sdk_disabled_is_the_line_not_an_otlp_sink(monkeypatch) -> None:
    from dflash.config.settings import TelemetryConfig

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    cfg = tracing_config(TelemetryConfig(otlp_endpoint="http://127.0.0.1:9"), rank=0, run_id="r")
    telemetry = setup_tracing(cfg)
    line = describe(cfg, telemetry)
    telemetry.shutdown(timeout_s=0.5)
    assert "OTLP" not in line
    assert "traces -> nowhere (OTEL_SDK_DISABLED=true: no spans, metrics or export" in line


@pytest.mark.usefixtures("tiny_target")
def test_drafter_bound_cpu_run_names_the_shared_device(tmp_path, monkeypatch, capsys) -> None:
    real_step = DrafterTrainer.step

    def slow_step(self, batch, target_out, phase=null_phase):
        time.sleep(0.03)  # drafters far slower than the target: targets block on hs_queue
        return real_step(self, batch, target_out, phase)

    monkeypatch.setattr(DrafterTrainer, "step", slow_step)
    obs, _ = observer(output_dir=tmp_path)
    lines: list[str] = []
    summary = run_pipeline(small_cfg(tmp_path, steps=16), log=lines.append, observer=obs)
    verdict = summary["verdict"]
    # Following "add drafter devices" would not help: both stages share the CPU.
    assert "drafter-bound" in verdict and "every stage runs on cpu" in verdict, verdict
    assert "add drafter devices" not in verdict
    assert f"verdict: {verdict}" in capsys.readouterr().err.splitlines()  # the final table
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["phases"]["hs_queue.put"]["count"] == 16
    assert "Acceptance per block position" in (tmp_path / "report.html").read_text()


@pytest.mark.usefixtures("tiny_target")
def test_ctrl_c_with_two_drafters_marks_no_span_error(tmp_path, monkeypatch) -> None:
    real_step = DrafterTrainer.step
    sent = threading.Event()

    def step(self, batch, target_out, phase=null_phase):
        result = real_step(self, batch, target_out, phase)
        if self.step_count == 3 and not sent.is_set():
            sent.set()
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(DrafterTrainer, "step", step)
    obs, exporter = observer()
    cfg = small_cfg(tmp_path, steps=500, drafter_devices=["cpu", "cpu"])
    with pytest.raises(TrainingInterrupted) as stopped:
        run_pipeline(cfg, log=lambda _: None, observer=obs)
    obs.close(lambda _: None)
    assert stopped.value.code == 130
    spans = exporter.get_finished_spans()
    assert sum(s.name == names.DRAFTER_STEP for s in spans) >= 4
    errors = [s.name for s in spans if s.status.status_code == StatusCode.ERROR]
    assert errors == []


SHORT_COLLECTIVE_TIMEOUT_S = 4.0


def _torchrun_worker(out_dir: Path) -> None:
    """Both ranks train through `run_training`; rank 0's evaluation outlasts the
    collective timeout, which the other rank must not wait out."""

    from dflash.pipeline import distributed
    from dflash.pipeline.distributed import dist_info_from_env
    from dflash.run import finish as run
    from dflash.run import pipelined as pipeline

    small_target_everywhere()
    distributed.COLLECTIVE_TIMEOUT_S = SHORT_COLLECTIVE_TIMEOUT_S
    # What static rendezvous gives every rank: no shared id from torchrun.
    os.environ["TORCHELASTIC_RUN_ID"] = "none"
    info = dist_info_from_env()
    real_evaluate = run.evaluate_run

    def slow_evaluate(*args, **kwargs):
        time.sleep(2 * SHORT_COLLECTIVE_TIMEOUT_S)
        return real_evaluate(*args, **kwargs)

    run.evaluate_run = slow_evaluate
    (out_dir / f"data{info.rank}").mkdir(parents=True, exist_ok=True)
    cfg = small_cfg(
        out_dir / f"data{info.rank}",
        out_dir / f"out{info.rank}",
        steps=4,
        trace_file=str(out_dir / "spans.jsonl"),
        timeline="off",
    )
    pipeline.run_training(cfg, log=print)


def _resource(path: Path) -> dict[str, object]:
    line = path.read_text().splitlines()[0]
    attrs = json.loads(line)["resourceSpans"][0]["resource"]["attributes"]
    return {a["key"]: next(iter(a["value"].values())) for a in attrs}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_two_ranks_share_a_run_id_and_outlast_a_slow_evaluation(tmp_path: Path) -> None:
    cmd = [*torchrun_command(2), __file__, str(tmp_path)]
    done = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads((tmp_path / "out0" / "summary.json").read_text())
    assert summary["eval_s"] > SHORT_COLLECTIVE_TIMEOUT_S
    # One trace file per rank; one run id for both, a service instance of each.
    ranks = [_resource(tmp_path / "spans.jsonl"), _resource(tmp_path / "spans.jsonl.rank1")]
    assert [int(r["dflash.rank"]) for r in ranks] == [0, 1]
    assert ranks[0]["dflash.run.id"] == ranks[1]["dflash.run.id"]
    assert ranks[0]["service.instance.id"] != ranks[1]["service.instance.id"]
    assert ranks[0]["service.name"] == "dflash-train"


if __name__ == "__main__":
    _torchrun_worker(Path(sys.argv[1]))


@pytest.mark.usefixtures("tiny_target")
def test_the_start_up_is_a_trace_of_its_own_and_reaches_the_tables(tmp_path) -> None:
    obs, exporter = observer()
    lines = traced_run(tmp_path, obs)
    spans = exporter.get_finished_spans()
    (startup,) = [s for s in spans if s.name == names.RUN_STARTUP]
    assert startup.parent is None  # a trace of its own, before the first batch
    children = {s.name for s in spans if s.parent and s.parent.span_id == startup.context.span_id}
    assert {names.TARGET_LOAD, names.DATA_PREPARE, names.DRAFTER_BUILD} <= children
    first_batch = min(s.start_time for s in spans if s.name == names.BATCH)
    assert startup.end_time <= first_batch
    final = obs.final_snapshot().phases
    for name in (names.RUN_STARTUP, names.TARGET_LOAD, names.DATA_PREPARE, names.DRAFTER_BUILD):
        assert final[name].count >= 1, name
    assert not any("no phases recorded" in line for line in lines)
