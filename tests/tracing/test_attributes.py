"""Attribute values are taken when they are set, on the setting thread: what a phase
span exports for a value is what the SDK's own span exports for the value the program
means (numpy as Python values, an Enum as its value). A later change to the object
never reaches the export; a tensor and a value that is not an OTel attribute value by
the specification (str, bool, int, float, a homogeneous list of one) are dropped with
one warning per key, alike on every SDK release (1.45 would stringify an object)."""

from __future__ import annotations

import enum
import logging

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing


class Color(str, enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Plain(enum.Enum):
    ONE = 1.5


class NotAnAttribute:
    def __str__(self) -> str:
        return "object"


# (value a program sets, the value it means)
VALUES = [
    (1, 1), (2.5, 2.5), ("s", "s"), (True, True), ([1, 2], [1, 2]), (("a", "b"), ("a", "b")),
    (np.float64(2.0), 2.0), (np.int64(3), 3), (np.float32(0.5), 0.5), (np.bool_(True), True),
    (np.array([1, 2]), [1, 2]), ([np.int64(1), np.int64(2)], [1, 2]),
    (Color.RED, "red"), (Level.HIGH, 3), (Plain.ONE, 1.5),
]  # fmt: skip
REFUSED = [None, {"k": 1}, NotAnAttribute(), [1, "x"], [[1], [2]], np.array([[1, 2]])]
PATHS = ["fast", "sdk"]


def _setup(path: str, memory: InMemorySpanExporter) -> tracing.Telemetry:
    """Tracing on its fast path (its own processors) or through the SDK's Tracer."""
    if path == "fast":
        return tracing.setup(tracing.TracingConfig(), exporters=[memory])
    return tracing.setup(tracing.TracingConfig(), span_processors=[SimpleSpanProcessor(memory)])


def _sdk_attributes(values: dict[str, object]) -> dict[str, object]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("s", attributes=values):
        pass
    provider.shutdown()
    return dict(exporter.get_finished_spans()[0].attributes)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.filterwarnings("ignore")
def test_phase_spans_export_what_the_sdk_exports_for_the_meant_value(path, memory) -> None:
    given = {f"v{i}": value for i, (value, _) in enumerate(VALUES)}
    meant = {f"v{i}": value for i, (_, value) in enumerate(VALUES)}
    given.update({f"refused{i}": value for i, value in enumerate(REFUSED)})
    telemetry = _setup(path, memory)
    with tracing.phase("p", attributes=given) as p:
        for key, value in given.items():
            p.set_attribute(f"late.{key}", value)
    telemetry.shutdown(timeout_s=2.0)
    exported = dict(memory.get_finished_spans()[0].attributes)
    late = {k.removeprefix("late."): v for k, v in exported.items() if k.startswith("late.")}
    early = {k: v for k, v in exported.items() if not k.startswith("late.")}
    assert early == late == _sdk_attributes(meant)
    # Spelled out for the values the SDK alone would drop, or turn into text:
    assert (early["v6"], early["v7"], early["v9"], early["v10"]) == (2.0, 3, True, (1, 2))
    assert type(early["v7"]) is int and type(early["v12"]) is str and early["v12"] == "red"
    assert _sdk_attributes({"x": np.int64(3)}) in ({"x": "3"}, {})


@pytest.mark.parametrize("path", PATHS)
def test_a_buffer_changed_after_its_phase_is_exported_as_it_was(path, memory) -> None:
    telemetry = _setup(path, memory)
    buffer = np.array([1.0, 2.0])
    with tracing.phase("step", attributes={"given": buffer}) as p:
        p.set_attribute("set", buffer)
    buffer[:] = 99.0  # the program reuses its buffer; the export thread has not run yet
    telemetry.shutdown(timeout_s=2.0)
    (span,) = memory.get_finished_spans()
    assert span.attributes["given"] == span.attributes["set"] == (1.0, 2.0)


@pytest.mark.parametrize("path", PATHS)
def test_a_tensor_is_refused_once_and_never_read(path, memory, caplog) -> None:
    torch = pytest.importorskip("torch")

    class Unreadable(torch.Tensor):  # reading it on any thread would be a host sync
        def item(self):  # type: ignore[no-untyped-def]
            raise AssertionError("read")

        def tolist(self):  # type: ignore[no-untyped-def]
            raise AssertionError("read")

    telemetry = _setup(path, memory)
    key = f"loss.{path}"
    with caplog.at_level(logging.WARNING, logger="tracing"):
        for _ in range(3):
            with tracing.phase("step", attributes={key: torch.ones(())}) as p:
                p.set_attribute(key, torch.ones(1).as_subclass(Unreadable))
                p.set_attribute("tokens", 64)
    telemetry.shutdown(timeout_s=2.0)
    warned = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(warned) == 1 and "tensor" in warned[0] and ".item()" in warned[0]
    assert [dict(s.attributes) for s in memory.get_finished_spans()] == [{"tokens": 64}] * 3


@pytest.mark.parametrize("path", PATHS)
def test_a_type_otel_does_not_take_is_dropped_with_one_warning_per_key(path, memory, caplog):
    telemetry = _setup(path, memory)
    keys = [f"{path}.object", f"{path}.mixed"]
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with tracing.phase("p") as p:
                p.set_attribute(keys[0], NotAnAttribute())
                p.set_attribute(keys[1], [1, "x"])
                p.set_attribute("kept", "yes")
    telemetry.shutdown(timeout_s=2.0)
    for key in keys:
        assert sum(key in r.getMessage() for r in caplog.records) == 1, caplog.text
    assert [dict(s.attributes) for s in memory.get_finished_spans()] == [{"kept": "yes"}] * 3
