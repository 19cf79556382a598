"""The dflash-train span tree (docs/design.md §5) and checks on traces as Jaeger returns them.

Jaeger's query API (and its /api/transform endpoint) answers in the UI's JSON: a trace
is {"traceID", "spans": [...], "processes": {...}}, a span has "spanID",
"operationName", "references" ([{"refType": "CHILD_OF", "spanID": ...}]), "startTime"
and "duration" in microseconds, "tags" ([{"key", "type", "value"}]) and "processID".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SERVICE_NAME = "dflash-train"

# Phase name -> expected parent phase (None for the root).
PARENT_OF: dict[str, str | None] = {
    "batch": None,
    "data.batch": "batch",
    "batch_queue.wait": "batch",
    "target.forward": "batch",
    "hs_queue.wait": "batch",
    "drafter.step": "batch",
    "drafter.anchor_selection": "drafter.step",
    "drafter.block_prediction": "drafter.step",
    "drafter.loss": "drafter.step",
    "drafter.backward": "drafter.step",
    "drafter.optimizer": "drafter.step",
}
PHASES = tuple(PARENT_OF)

Span = dict[str, Any]
Trace = dict[str, Any]


def tags(span: Span) -> dict[str, Any]:
    return {tag["key"]: tag["value"] for tag in span.get("tags", [])}


def service_of(trace: Trace, span: Span) -> str:
    return trace["processes"][span["processID"]]["serviceName"]


def spans_by_name(trace: Trace) -> dict[str, list[Span]]:
    found: dict[str, list[Span]] = {}
    for span in trace["spans"]:
        found.setdefault(span["operationName"], []).append(span)
    return found


def parent_span(trace: Trace, span: Span) -> Span | None:
    by_id = {s["spanID"]: s for s in trace["spans"]}
    for ref in span.get("references") or []:
        if ref["refType"] == "CHILD_OF":
            return by_id.get(ref["spanID"], {"operationName": f"<missing {ref['spanID']}>"})
    return None


def batch_tree_problems(trace: Trace) -> list[str]:
    """Every way `trace` differs from one complete batch tree; empty when it is one.

    Each phase appears exactly once under its expected parent; the drafter's sub-phases
    lie inside drafter.step. Wait spans are not checked for containment: they start
    when the consumer began waiting, which may precede the batch's own start.
    """
    problems = []
    by_name = spans_by_name(trace)
    for name, expected_parent in PARENT_OF.items():
        spans = by_name.get(name, [])
        if len(spans) != 1:
            problems.append(f"{name}: {len(spans)} spans, expected 1")
            continue
        parent = parent_span(trace, spans[0])
        parent_name = None if parent is None else parent["operationName"]
        if parent_name != expected_parent:
            problems.append(f"{name}: parent {parent_name}, expected {expected_parent}")
    step = by_name.get("drafter.step", [])
    if len(step) == 1:
        start_us = step[0]["startTime"]
        end_us = start_us + step[0]["duration"]
        for name, parent in PARENT_OF.items():
            for span in by_name.get(name, []) if parent == "drafter.step" else []:
                # Jaeger rounds to microseconds; allow one of slack at each end.
                if (
                    span["startTime"] < start_us - 1
                    or span["startTime"] + span["duration"] > end_us + 1
                ):
                    problems.append(f"{name}: outside drafter.step")
    return problems


def find_root(trace: Trace) -> Span | None:
    """The one span without a parent in the trace; None for a trace whose root was lost
    (spans of one trace travel in different export batches, so an outage can split it)."""
    roots = [s for s in trace["spans"] if parent_span(trace, s) is None]
    return roots[0] if len(roots) == 1 else None


def root_of(trace: Trace) -> Span:
    root = find_root(trace)
    assert root is not None, f"trace {trace['traceID']} has no single root"
    return root


def merge_otlp_json_lines(path: Path) -> bytes:
    """One request out of an OTLP/JSON file of one ExportTraceServiceRequest per line.

    Jaeger's /api/transform takes a single request object; a trace file holds one per
    export call, so their resourceSpans are concatenated.
    """
    resource_spans: list[Any] = []
    for line in path.read_text().splitlines():
        if line.strip():
            resource_spans.extend(json.loads(line).get("resourceSpans", []))
    return json.dumps({"resourceSpans": resource_spans}).encode()
