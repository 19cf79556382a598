"""Span links of a real run, read back from its --trace-file (OTLP JSON): an optimizer
update links to the other replicas' batches, whose gradients it applied, on its own rank
and on the others; checkpoint and eval spans, in traces of their own, link to the last
step before them.

Run as a script under torchrun, this file is also the worker of the two-rank test:
`torchrun --nproc-per-node 2 tests/dflash/observe/test_span_links.py {replicated|sharded} OUT_DIR`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.trace import Link, SpanContext, TraceFlags

from dflash import names
from dflash.pipeline.distributed import SpanIds
from dflash.run.pipelined import run_training
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    run_torchrun_script,
    small_cfg,
    small_target_everywhere,
    tiny_target,
)

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


def _link(trace_id: int, span_id: int, batch_id: int) -> Link:
    context = SpanContext(trace_id, span_id, False, TraceFlags(TraceFlags.SAMPLED))
    return Link(context, {names.STEP: 7, names.BATCH_ID: batch_id})


def test_span_ids_survive_a_float32_sum_of_every_ranks_words() -> None:
    """The ids ride in the gradients' float32 all-reduce: each rank's words plus the
    others' zeros, summed in any order, are its ids to the bit, the 128-bit ones too."""
    ids = [SpanIds(world_size=3, rank=r, replicas=2) for r in range(3)]
    top, other = (1 << 128) - 1, 0x0123456789ABCDEF0011223344556677  # every bit set, any
    words = [
        ids[0].encode([(0, _link(top, (1 << 64) - 1, 0)), (1, _link(5, 6, 2**40))]),
        ids[1].encode([]),  # tracing off, or no span sampled: zeros, no link
        ids[2].encode([(1, _link(other, 0xFEDCBA9876543210, 3))]),
    ]
    from_0 = [
        (top, (1 << 64) - 1, {names.STEP: 7, names.BATCH_ID: 0, names.RANK: 0}),
        (5, 6, {names.STEP: 7, names.BATCH_ID: 2**40, names.RANK: 0}),
    ]
    from_2 = [(other, 0xFEDCBA9876543210, {names.STEP: 7, names.BATCH_ID: 3, names.RANK: 2})]
    for order in ((0, 1, 2), (2, 1, 0), (1, 2, 0)):
        total = torch.zeros(ids[0].size, dtype=torch.float32)
        for r in order:
            total += torch.from_numpy(words[r])
        seen = {}
        for r in range(3):
            links = ids[r].decode(total.numpy(), step=7)
            assert all(k.context.is_remote and k.context.trace_flags.sampled for k in links)
            seen[r] = [(k.context.trace_id, k.context.span_id, dict(k.attributes)) for k in links]
        assert seen == {0: from_2, 1: from_0 + from_2, 2: from_0}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
@pytest.mark.parametrize(("mode", "per_rank"), [("replicated", 2), ("sharded", 1)])
def test_updates_link_every_ranks_batches(tmp_path: Path, mode: str, per_rank: int) -> None:
    """2 gloo ranks: each rank's update of step s links to the drafter.step span of every
    replica of step s but its own, on both ranks: the ids of the spans in the other
    rank's trace file, with that span's step and batch id and the rank."""
    run_torchrun_script(__file__, mode, str(tmp_path))
    trace_file = tmp_path / "spans.jsonl"
    files = {0: trace_file, 1: trace_file.with_name(trace_file.name + ".rank1")}
    spans = {rank: _spans(path) for rank, path in files.items()}
    steps = {
        rank: {s["spanId"]: s for s in found if s["name"] == names.DRAFTER_STEP}
        for rank, found in spans.items()
    }
    for rank, found in spans.items():
        other = 1 - rank
        assert len(steps[rank]) == per_rank * STEPS
        updates = [s for s in found if s["name"] == names.OPTIMIZER]
        assert len(updates) == per_rank * STEPS
        for update in updates:
            own = steps[rank][update["parentSpanId"]]
            number = own["attributes"][names.STEP]
            local = {
                sid
                for sid, s in steps[rank].items()
                if s["attributes"][names.STEP] == number and sid != own["spanId"]
            }
            remote = {
                sid for sid, s in steps[other].items() if s["attributes"][names.STEP] == number
            }
            assert len(local) == per_rank - 1 and len(remote) == per_rank
            links = update.get("links", [])
            assert {link["spanId"] for link in links} == local | remote
            for link in links:
                if link["spanId"] in local:
                    continue
                target = steps[other][link["spanId"]]
                assert link["traceId"] == target["traceId"]
                assert link["attributes"] == {
                    names.STEP: number,
                    names.BATCH_ID: target["attributes"][names.BATCH_ID],
                    names.RANK: other,
                }
    # Each rank trained its own batches: the links cross between different ones.
    batch_ids = [{s["attributes"][names.BATCH_ID] for s in steps[r].values()} for r in (0, 1)]
    assert not batch_ids[0] & batch_ids[1]


def _rank_worker(mode: str, out_dir: Path) -> None:
    small_target_everywhere()
    from dflash.pipeline.distributed import dist_info_from_env

    rank = dist_info_from_env().rank
    data_dir = out_dir / f"data{rank}"  # one corpus file per rank: no write race
    data_dir.mkdir(parents=True, exist_ok=True)
    layout = {"shard_drafter": True} if mode == "sharded" else {"drafter_devices": ("cpu", "cpu")}
    cfg = small_cfg(
        data_dir,
        out_dir / f"out{rank}",
        steps=STEPS,
        trace_file=str(out_dir / "spans.jsonl"),  # rank 1 writes spans.jsonl.rank1
        trace_sample_ratio=1.0,
        timeline="off",
        **layout,
    )
    run_training(cfg, log=lambda _: None)


if __name__ == "__main__":
    _rank_worker(sys.argv[1], Path(sys.argv[2]))
