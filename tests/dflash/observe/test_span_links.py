"""Span links of a real run, read back from its --trace-file (OTLP JSON): an optimizer
update links to the other replica's batch, whose gradients it applied; checkpoint and
eval spans, in traces of their own, link to the last step before them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash import names
from dflash.run.pipelined import run_training
from tests.dflash.app_fixtures import small_cfg, tiny_target  # noqa: F401 - fixture

STEPS = 4


def _value(value: dict[str, Any]) -> Any:
    (kind, raw), *_ = value.items()
    return int(raw) if kind == "intValue" else raw


def _attributes(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _value(a["value"]) for a in items}


def _spans(path: Path) -> list[dict[str, Any]]:
    """Every span of an OTLP JSON lines file, its attributes and links' made plain."""
    spans = []
    for line in path.read_text().splitlines():
        for resource in json.loads(line)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    span["attributes"] = _attributes(span.get("attributes", []))
                    for link in span.get("links", []):
                        link["attributes"] = _attributes(link.get("attributes", []))
                    spans.append(span)
    return spans


@pytest.mark.usefixtures("tiny_target")
def test_updates_link_the_batches_they_average_and_saves_link_the_last_step(tmp_path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    cfg = small_cfg(
        tmp_path,
        tmp_path / "out",
        steps=STEPS,
        drafter_devices=("cpu", "cpu"),
        grad_accum=2,
        log_every=2,
        save_every=2,
        eval_prompts=2,
        eval_every=2,
        eval_new_tokens=4,
        trace_file=str(trace_file),
        timeline="off",
    )
    run_training(cfg, log=lambda _: None)
    spans = _spans(trace_file)
    by_id = {s["spanId"]: s for s in spans}

    def parent(span: dict[str, Any]) -> dict[str, Any]:
        return by_id[span["parentSpanId"]]

    def linked(span: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        out = []
        for link in span.get("links", []):
            target = by_id[link["spanId"]]
            assert target["traceId"] == link["traceId"]
            out.append((target, link["attributes"]))
        return out

    steps = [s for s in spans if s["name"] == names.DRAFTER_STEP]
    assert len(steps) == 2 * STEPS  # two replicas, each its own batch (trace) per step
    assert all(not s.get("links") for s in steps)

    # Each update applies both replicas' gradients: it links to the other one's step.
    optimizers = [s for s in spans if s["name"] == names.OPTIMIZER]
    assert len(optimizers) == 2 * STEPS
    for update in optimizers:
        own = parent(update)
        assert own["name"] == names.DRAFTER_STEP
        ((other, attributes),) = linked(update)
        assert other["name"] == names.DRAFTER_STEP and other["traceId"] != update["traceId"]
        assert other["attributes"][names.STEP] == own["attributes"][names.STEP]
        assert other["attributes"][names.THREAD_NAME] != own["attributes"][names.THREAD_NAME]
        assert attributes == {
            names.STEP: other["attributes"][names.STEP],
            names.BATCH_ID: other["attributes"][names.BATCH_ID],
        }
        # --grad-accum 2: the micro-batches are rows of this step's batch, their
        # backward passes under the same drafter.step, in the update's own trace.
        backwards = [
            s
            for s in spans
            if s["name"] == names.BACKWARD and s.get("parentSpanId") == own["spanId"]
        ]
        assert len(backwards) == 2 and {b["traceId"] for b in backwards} == {update["traceId"]}

    # Checkpoint and eval spans: their own traces, a link to replica 0's last step.
    def last_step_of(span: dict[str, Any]) -> int:
        assert span.get("parentSpanId", "") == ""  # a root: a trace of its own
        ((step, attributes),) = linked(span)
        assert step["name"] == names.DRAFTER_STEP
        assert step["attributes"][names.THREAD_NAME] == "drafter-0"
        assert step["endTimeUnixNano"] <= span["startTimeUnixNano"]
        assert attributes == {names.STEP: step["attributes"][names.STEP]}
        return attributes[names.STEP]

    saves = sorted((s for s in spans if s["name"] == names.CHECKPOINT_SAVE), key=_start)
    assert [last_step_of(s) for s in saves] == [1, STEPS - 1]  # after step 2, the final one
    evals = sorted((s for s in spans if s["name"] == names.EVAL), key=_start)
    assert [last_step_of(s) for s in evals] == [1, STEPS - 1]


def _start(span: dict[str, Any]) -> int:
    return int(span["startTimeUnixNano"])
