"""Tracing the pipeline end to end (issue 5): real runs into the SDK's in-memory exporter."""

import json

import pytest
from app_fixtures import small_cfg, tiny_target  # noqa: F401 - fixture
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import tracing
from dflash import names
from dflash.observe import Observer, describe, tracing_config
from dflash.pipeline import PipelineError, run_pipeline
from dflash.stages import Pipeline
from dflash.step import DrafterTrainer, null_phase

STEPS = 4
PARENT = {
    names.DATA_BATCH: names.BATCH,
    names.BATCH_QUEUE_WAIT: names.BATCH,
    names.TARGET_FORWARD: names.BATCH,
    names.HS_QUEUE_WAIT: names.BATCH,
    names.DRAFTER_STEP: names.BATCH,
    **{p: names.DRAFTER_STEP for p in names.DRAFTER_PHASES},
}


def observer(sample_ratio: float = 1.0) -> tuple[Observer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    cfg = tracing.TracingConfig(
        sample_ratio=sample_ratio, report_interval_s=60, attribute_namespace="dflash"
    )
    telemetry = tracing.setup(cfg, span_processors=[SimpleSpanProcessor(exporter)])
    return Observer(cfg, telemetry, world_size=1), exporter


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
    return {r.context.trace_id: [s for s in spans if s.context.trace_id == r.context.trace_id]
            for r in roots}  # fmt: skip


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
    logged = {named_step(t): t for t in trees.values()
              if names.METRIC_LOSS in step_span(t).attributes}  # fmt: skip
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
    failed = {s.name: s for s in exporter.get_finished_spans() if s.status.status_code
              == StatusCode.ERROR}  # fmt: skip
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
    assert counts[1.0]["hs_queue.wait"] == 400
    assert exported[1.0] == 400
    assert 10 <= exported[0.1] <= 80  # binomial(400, 0.1): mean 40, sd 6


def test_flags_win_over_otel_variables(monkeypatch) -> None:
    from dflash.config import TelemetryConfig

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    cfg = tracing_config(TelemetryConfig(), rank=1, run_id="r")
    assert (cfg.otlp_endpoint, cfg.otlp_protocol, cfg.service_name) == (
        "http://127.0.0.1:9", "http", "from-env",
    )  # fmt: skip
    cfg = tracing_config(
        TelemetryConfig(otlp_protocol="grpc", service_name="flag", trace_sample_ratio=0.5),
        rank=1, run_id="r",
    )  # fmt: skip
    assert (cfg.otlp_protocol, cfg.service_name, cfg.sample_ratio) == ("grpc", "flag", 0.5)
    line = describe(cfg)
    assert "OTLP/grpc http://127.0.0.1:9" in line and "sample ratio 0.5" in line
    assert cfg.service_instance_id in line and cfg.rank == 1
