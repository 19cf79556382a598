"""The metrics a training run exports (names, units, labels) and their wiring to tracing.

Every instrument is listed in METRICS: the Grafana dashboard and the stack checks
(tests/test_stack_config.py) derive the Prometheus names from this one table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.resources import Resource

from tracing import ProfileStats, TracingConfig, TracingConfigError
from tracing.metrics import Metrics, MetricsConfig, start_metrics

NAMESPACE = "dflash"
"""Prefix of the instrument names and the traces' `attribute_namespace`: the resource
keys `dflash.run.id` and `dflash.rank` become the labels the dashboard selects by."""
Reader = Callable[[], float]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    """Without the namespace: `tokens` is exported as `dflash.tokens`."""
    kind: str
    """counter (monotonic, read by callback), updowncounter (a count that rises and falls,
    read by callback), gauge (a reading: callback or per logged step), histogram."""
    unit: str
    description: str
    labels: tuple[str, ...] = ()
    """Attribute keys, namespaced as the semantic conventions ask of an application's own."""


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("tokens", "counter", "{token}", "Tokens through each stage.", ("dflash.stage",)),
    MetricSpec(
        "steps", "counter", "{step}", "Batches (target) and steps (drafter).", ("dflash.stage",)
    ),
    MetricSpec(
        "queue.size", "updowncounter", "{batch}", "Items waiting in each queue.", ("dflash.queue",)
    ),
    MetricSpec(
        "phase.duration", "histogram", "s", "Every phase, sampled or not.", ("dflash.phase",)
    ),
    MetricSpec("train.loss", "gauge", "{nat}", "Training loss at the last logged step."),
    MetricSpec(
        "train.acceptance_length", "gauge", "{token}", "τ estimate at the last logged step."
    ),
    MetricSpec(
        "eval.acceptance_length",
        "gauge",
        "{token}",
        "τ on the held-out prompts (speculative decoding) at the last evaluation.",
    ),
    # Dimensionless but not ratios: an annotation, so Prometheus adds no `_ratio` suffix.
    MetricSpec(
        "train.learning_rate", "gauge", "{learning_rate}", "Learning rate at the last logged step."
    ),
    MetricSpec("train.grad_norm", "gauge", "{norm}", "Gradient norm at the last logged step."),
    MetricSpec("train.mfu", "gauge", "1", "Model FLOPs utilization of the drafter devices."),
    MetricSpec(
        "train.skipped_steps",
        "counter",
        "{step}",
        "Steps skipped with a loss or gradient norm not finite (no update), at logged steps.",
    ),
    MetricSpec(
        "cache.skipped_samples",
        "counter",
        "{sample}",
        "Hidden-cache samples left out or cut, by reason (missing, unreadable, ...).",
        ("dflash.reason",),
    ),
    MetricSpec(
        "spool.usage",
        "updowncounter",
        "By",
        "Bytes the vLLM engine's spool holds now (--target-engine vllm): at its bound, the "
        "engine waits for training.",
    ),
    MetricSpec(
        "spool.samples",
        "updowncounter",
        "{sample}",
        "Samples written whole into the spool and not yet read (--target-engine vllm): none "
        "while training waits, the engine is the limit.",
    ),
    MetricSpec(
        "telemetry.spans",
        "counter",
        "{span}",
        "Sampled spans by what became of them: handed to the exporters, exported, failed.",
        ("dflash.outcome",),
    ),
    MetricSpec(
        "device.memory.allocated",
        "gauge",
        "By",
        "Device memory allocated by tensors now.",
        ("dflash.device",),
    ),
    MetricSpec(
        "device.memory.reserved",
        "gauge",
        "By",
        "Device memory reserved by the caching allocator now.",
        ("dflash.device",),
    ),
    MetricSpec(
        "device.memory.peak",
        "gauge",
        "By",
        "Most device memory allocated at once in the run so far (torch's peak is never reset).",
        ("dflash.device",),
    ),
)
MEMORY_FIGURES = ("allocated", "reserved", "peak")
"""The device.memory.* gauges: `start_run_metrics(memory=)` gives a reader of each."""
SPOOL_FIGURES = ("usage", "samples")
"""The spool.* readings: `start_run_metrics(spool=)` gives a reader of each."""
SPECS = {spec.name: spec for spec in METRICS}
STEP_GAUGES = {
    "loss": "train.loss",
    "tau": "train.acceptance_length",
    "eval_tau": "eval.acceptance_length",
    "lr": "train.learning_rate",
    "grad_norm": "train.grad_norm",
    "mfu": "train.mfu",
}


def start_run_metrics(
    tracing_cfg: TracingConfig,
    stats: ProfileStats,
    *,
    tokens: Mapping[str, Reader],
    steps: Mapping[str, Reader],
    queues: Mapping[str, Reader],
    memory: Mapping[str, Mapping[str, Reader]] | None = None,
    skipped_steps: Reader | None = None,
    skipped_samples: Mapping[str, Reader] | None = None,
    spans: Mapping[str, Reader] | None = None,
    spool: Mapping[str, Reader] | None = None,
    exporters: Sequence[MetricExporter] = (),
    resource: Resource | None = None,
    on_export_problem: Callable[[str], None] | None = None,
    **cfg_overrides: Any,  # Any: MetricsConfig's fields, of their several types
) -> Metrics:
    """Metrics of one rank: `tokens`/`steps` map a stage name to a monotonic counter,
    `queues` a queue name to its depth, `memory` a device to a reader of each of
    MEMORY_FIGURES (bytes: allocated and reserved now, the run's peak), `skipped_steps`
    the steps skipped as non-finite, `skipped_samples` a reason to the hidden-cache
    samples it left out, `spans` an outcome to the sampled spans it counts (the
    exporters' own delivery: a span that was handed and neither exported nor failed
    waits in the queue or was dropped), `spool` a reader of each of SPOOL_FIGURES (a
    streamed run's spool: bytes and whole samples it holds now). Endpoint and protocol
    follow the traces' flags, else the OTEL_* variables (the SDK reads them); the
    resource is the traces' (`resource`, else built from `tracing_cfg`, whose
    attribute_namespace must be NAMESPACE); `on_export_problem` gets the line that
    tells a failing export (tracing.metrics.start_metrics)."""
    if tracing_cfg.attribute_namespace != NAMESPACE:
        raise TracingConfigError(
            f"run metrics need attribute_namespace {NAMESPACE!r} (the dashboard selects runs "
            f"by {NAMESPACE}_run_id), got {tracing_cfg.attribute_namespace!r}"
        )
    cfg = MetricsConfig(namespace=NAMESPACE, **cfg_overrides)
    metrics = start_metrics(
        cfg,
        tracing_cfg,
        exporters=exporters,
        resource=resource,
        on_export_problem=on_export_problem,
    )
    for stage, fn in tokens.items():
        _observe(metrics, "tokens", fn, stage)
    for stage, fn in steps.items():
        _observe(metrics, "steps", fn, stage)
    for queue, fn in queues.items():
        _observe(metrics, "queue.size", fn, queue)
    for device, figures in (memory or {}).items():
        for figure in MEMORY_FIGURES:
            _observe(metrics, f"device.memory.{figure}", figures[figure], device)
    for reason, fn in (skipped_samples or {}).items():
        _observe(metrics, "cache.skipped_samples", fn, reason)
    for outcome, fn in (spans or {}).items():
        _observe(metrics, "telemetry.spans", fn, outcome)
    for figure, fn in (spool or {}).items():
        spec = SPECS[f"spool.{figure}"]
        metrics.observe(
            spec.kind,  # type: ignore[arg-type]  # SPECS' kinds are the Literal's strings
            spec.name,
            fn,
            unit=spec.unit,
            description=spec.description,
        )
    if skipped_steps is not None:
        spec = SPECS["train.skipped_steps"]
        metrics.observe(
            "counter", spec.name, skipped_steps, unit=spec.unit, description=spec.description
        )
    spec = SPECS["phase.duration"]
    metrics.observe_stats(stats, spec.name, spec.description)
    for name in STEP_GAUGES.values():
        spec = SPECS[name]
        metrics.gauge(spec.name, unit=spec.unit, description=spec.description)
    return metrics


def _observe(metrics: Metrics, name: str, fn: Reader, label_value: str) -> None:
    spec = SPECS[name]
    (label,) = spec.labels
    metrics.observe(
        spec.kind,  # type: ignore[arg-type]  # SPECS' kinds are the Literal's strings
        name,
        fn,
        unit=spec.unit,
        description=spec.description,
        attributes={label: label_value},
    )


def record_step(metrics: Metrics, **values: float | None) -> None:
    """Once per logged step: loss=, tau=, eval_tau=, lr=, grad_norm=, mfu= (None ones are
    skipped: eval_tau is given on evaluated steps only)."""
    unknown = set(values) - set(STEP_GAUGES)
    if unknown:
        raise TypeError(f"record_step got unknown figure(s): {', '.join(sorted(unknown))}")
    metrics.record({STEP_GAUGES[key]: value for key, value in values.items()})
