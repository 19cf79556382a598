"""One frozen, validated settings tree for a training run.

Click flags, `DFLASH_*` variables and `--config` files all end up here; each
section validates itself in `__post_init__` and names the flag to change, so the
Python API and the command line reject the same values with the same message.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A setting has a bad value; the message is one line naming the flag."""


def _fail(flag: str, value: Any, reason: str) -> None:
    raise ConfigError(f"{flag} {value!r} is invalid: {reason}")


def _check_min(flag: str, value: float, minimum: float) -> None:
    if value < minimum:
        _fail(flag, value, f"must be at least {minimum}")


def _check_unit_interval(flag: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        _fail(flag, value, "must lie in [0, 1]")


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(flag, value, f"expected one of {', '.join(choices)}")


@dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it is cut into rows."""

    source: str = "embedded"
    """`embedded`, a text file, a folder of text files, or a JSONL file (`--data`)."""
    seq_len: int = 128
    """Tokens per packed row (`--seq-len`)."""
    batch_size: int = 4
    """Rows per training batch (`--batch-size`)."""
    heldout_fraction: float = 0.05
    """Share of documents kept out of training for evaluation."""

    def __post_init__(self) -> None:
        if not self.source.strip():
            _fail("--data", self.source, "must name `embedded`, a file or a folder")
        _check_min("--seq-len", self.seq_len, 8)
        _check_min("--batch-size", self.batch_size, 1)
        if not 0.0 < self.heldout_fraction < 1.0:
            _fail("heldout_fraction", self.heldout_fraction, "must lie strictly in (0, 1)")


@dataclass(frozen=True)
class TargetConfig:
    """The frozen target model and which of its layers feed the drafter."""

    spec: str = "builtin:tiny"
    """`builtin:tiny`, a local Hugging Face directory or a hub id (`--target`)."""
    layer_ids: tuple[int, ...] | None = None
    """0-based decoder layers whose outputs are captured; None spreads them evenly."""

    def __post_init__(self) -> None:
        if not self.spec.strip():
            _fail("--target", self.spec, "must not be empty")
        if self.layer_ids is not None:
            if not self.layer_ids:
                _fail("--target-layers", "", "give at least one layer id")
            if any(i < 0 for i in self.layer_ids):
                _fail("--target-layers", ",".join(map(str, self.layer_ids)), "ids must be >= 0")
            if len(set(self.layer_ids)) != len(self.layer_ids):
                _fail("--target-layers", ",".join(map(str, self.layer_ids)), "ids repeat")


@dataclass(frozen=True)
class DrafterSettings:
    """Shape of the drafter that is trained."""

    num_layers: int = 1
    """Drafter decoder layers (`--drafter-layers`)."""
    block_size: int = 8
    """Tokens per block: the anchor plus block_size-1 predictions (`--block-size`)."""

    def __post_init__(self) -> None:
        _check_min("--drafter-layers", self.num_layers, 1)
        _check_min("--block-size", self.block_size, 2)


@dataclass(frozen=True)
class ObjectiveConfig:
    """Anchors and the weighted loss (DESIGN.md §4)."""

    num_anchors: int = 16
    """Anchors (blocks) sampled per sequence (`--num-anchors`)."""
    loss_decay_gamma: float | None = None
    """γ of the exp(-(k-1)/γ) position weight; None picks it from the block size."""
    use_soft_labels: bool = False
    """Distill from the target's logits as well as the hard labels."""
    kl_temperature: float = 1.0
    """Softmax temperature of the distillation KL (`--kl-temperature`)."""
    kl_weight: float = 0.5
    """Share of KL in the loss when soft labels are on: kl_weight*KL + (1-kl_weight)*CE."""
    streak_alpha: float | None = None
    """Streak-aware weighting strength in [0, 1]; None turns it off (`--streak-alpha`)."""

    def __post_init__(self) -> None:
        _check_min("--num-anchors", self.num_anchors, 1)
        if self.loss_decay_gamma is not None and not self.loss_decay_gamma > 0:
            _fail("--loss-decay-gamma", self.loss_decay_gamma, "must be > 0")
        if not self.kl_temperature > 0:
            _fail("--kl-temperature", self.kl_temperature, "must be > 0")
        _check_unit_interval("--kl-weight", self.kl_weight)
        if self.streak_alpha is not None:
            _check_unit_interval("--streak-alpha", self.streak_alpha)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with a cosine schedule after a linear warmup."""

    lr: float = 2e-3
    """Peak learning rate (`--lr`)."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to the peak (`--warmup-steps`)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables (`--grad-clip`)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (`--weight-decay`)."""
    min_lr_ratio: float = 0.1
    """The cosine ends at min_lr_ratio * lr."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            _fail("--lr", self.lr, "must be > 0")
        _check_min("--warmup-steps", self.warmup_steps, 0)
        _check_min("--grad-clip", self.grad_clip, 0.0)
        _check_min("--weight-decay", self.weight_decay, 0.0)
        _check_unit_interval("min_lr_ratio", self.min_lr_ratio)


@dataclass(frozen=True)
class RunConfig:
    """Length, seed, outputs and evaluation of one run."""

    steps: int = 600
    """Optimizer steps to train (`--steps`)."""
    seed: int = 0
    """Seed of data order, anchors and initial weights (`--seed`)."""
    output_dir: str = "runs/default"
    """Final drafter, checkpoints and summary.json go here (`--output-dir`)."""
    resume: str | None = None
    """Checkpoint directory or `latest` to continue from (`--resume`)."""
    save_every: int = 0
    """Write a checkpoint every this many steps; 0 only at the end (`--save-every`)."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept; older ones are deleted."""
    eval_prompts: int = 8
    """Held-out prompts used to measure τ at the end (`--eval-prompts`)."""
    eval_new_tokens: int = 64
    """Tokens generated per evaluation prompt (`--eval-new-tokens`)."""
    eval_prompt_tokens: int = 64
    """Length of each evaluation prompt in tokens (`--eval-prompt-tokens`)."""
    debug: bool = False
    """Show full tracebacks instead of one-line errors (`--debug`)."""

    def __post_init__(self) -> None:
        _check_min("--steps", self.steps, 1)
        _check_min("--save-every", self.save_every, 0)
        _check_min("keep_checkpoints", self.keep_checkpoints, 1)
        _check_min("--eval-prompts", self.eval_prompts, 0)
        _check_min("--eval-new-tokens", self.eval_new_tokens, 1)
        _check_min("--eval-prompt-tokens", self.eval_prompt_tokens, 1)
        if not self.output_dir.strip():
            _fail("--output-dir", self.output_dir, "must not be empty")


_DEVICE_RE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


def parse_device_list(flag: str, value: str) -> tuple[str, ...]:
    """`cuda:0,cuda:1` -> ('cuda:0', 'cuda:1'); `auto` stays a single entry."""
    names = tuple(p.strip() for p in value.split(",") if p.strip())
    if names == ("auto",):
        return names
    if not names:
        _fail(flag, value, "name at least one device")
    for name in names:
        if not _DEVICE_RE.match(name):
            _fail(flag, name, "expected auto, cpu, mps, cuda or cuda:N")
    return names


@dataclass(frozen=True)
class PipelineConfig:
    """Devices and queue sizes of the producer-consumer pipeline (DESIGN.md §3).

    `auto` is resolved on the machine that runs (dflash.devices.resolve_devices):
    cpu without GPUs; one GPU serves both sides; otherwise the first half of the
    visible GPUs run the target and the rest train drafters.
    """

    target_devices: tuple[str, ...] = ("auto",)
    """Devices running the target (`--target-devices`)."""
    drafter_devices: tuple[str, ...] = ("auto",)
    """Devices training drafter replicas (`--drafter-devices`)."""
    batch_queue_size: int = 4
    """Batches prefetched ahead of the target threads (`--batch-queue-size`)."""
    hs_queue_size: int = 2
    """Hidden-state batches buffered between target and drafters (`--hs-queue-size`)."""

    def __post_init__(self) -> None:
        for flag, names in (
            ("--target-devices", self.target_devices),
            ("--drafter-devices", self.drafter_devices),
        ):
            parse_device_list(flag, ",".join(names))
        _check_min("--batch-queue-size", self.batch_queue_size, 1)
        _check_min("--hs-queue-size", self.hs_queue_size, 1)


@dataclass(frozen=True)
class TelemetryConfig:
    """Tracing and interval tables (DESIGN.md §5–§8); the tracing helpers read it."""

    otlp_endpoint: str | None = None
    """OTLP collector address; None sends nothing over the network (`--otlp-endpoint`)."""
    otlp_protocol: str | None = None
    """`grpc` (port 4317) or `http` (protobuf, port 4318) (`--otlp-protocol`); None uses
    OTEL_EXPORTER_OTLP_PROTOCOL, else grpc."""
    trace_level: str = "phase"
    """`off`, `step` or `phase` (`--trace-level`)."""
    trace_sample_ratio: float | None = None
    """Share of batch traces exported; tables always see every phase. None uses
    OTEL_TRACES_SAMPLER[_ARG], else 1.0."""
    trace_file: str | None = None
    """Also write spans as JSON lines to this file (`--trace-file`)."""
    cuda_timing: str = "off"
    """`off`, `sync` or `events` device timing of phases (`--cuda-timing`)."""
    profile_interval_s: float = 30.0
    """Seconds between interval tables (`--profile-interval`)."""
    service_name: str | None = None
    """OpenTelemetry service.name; None uses OTEL_SERVICE_NAME or dflash-train."""

    def __post_init__(self) -> None:
        if self.otlp_protocol is not None:
            _check_choice("--otlp-protocol", self.otlp_protocol, ("grpc", "http"))
        _check_choice("--trace-level", self.trace_level, ("off", "step", "phase"))
        if self.trace_sample_ratio is not None:
            _check_unit_interval("--trace-sample-ratio", self.trace_sample_ratio)
        _check_choice("--cuda-timing", self.cuda_timing, ("off", "sync", "events"))
        if not self.profile_interval_s > 0:
            _fail("--profile-interval", self.profile_interval_s, "must be > 0 seconds")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.strip():
            _fail("--otlp-endpoint", self.otlp_endpoint, "must not be empty")


@dataclass(frozen=True)
class TrainConfig:
    """The whole run: one section per component."""

    data: DataConfig = field(default_factory=DataConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterSettings = field(default_factory=DrafterSettings)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    @property
    def gamma(self) -> float:
        """The loss decay γ actually used (explicit or by block size)."""
        if self.objective.loss_decay_gamma is not None:
            return self.objective.loss_decay_gamma
        from dflash.objective import default_gamma  # torch-heavy: import only when asked

        return default_gamma(self.drafter.block_size)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain JSON-able dict (tuples become lists); `from_dict` reads it back."""
        out: dict[str, dict[str, Any]] = {}
        for f in dataclasses.fields(self):
            section = dataclasses.asdict(getattr(self, f.name))
            out[f.name] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        """Inverse of `to_dict`; unknown sections or keys are a ConfigError."""
        sections = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, values in raw.items():
            if name not in sections:
                raise ConfigError(f"unknown config section {name!r}")
            section_cls = _SECTION_TYPES[name]
            known = {f.name for f in dataclasses.fields(section_cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ConfigError(f"unknown key {unknown[0]!r} in config section {name!r}")
            fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
            kwargs[name] = section_cls(**fixed)
        return cls(**kwargs)

    def replace(self, **sections: Any) -> TrainConfig:
        """Copy with whole sections or `section__field=value` overrides."""
        updates: dict[str, Any] = {}
        for key, value in sections.items():
            if "__" in key:
                sec, fld = key.split("__", 1)
                base = updates.get(sec, getattr(self, sec))
                updates[sec] = dataclasses.replace(base, **{fld: value})
            else:
                updates[key] = value
        return dataclasses.replace(self, **updates)


_SECTION_TYPES: dict[str, type] = {
    "data": DataConfig,
    "target": TargetConfig,
    "drafter": DrafterSettings,
    "objective": ObjectiveConfig,
    "optim": OptimConfig,
    "run": RunConfig,
    "pipeline": PipelineConfig,
    "telemetry": TelemetryConfig,
}

# Command-line option name (snake_case) -> (section, field). The CLI, the config
# file and the DFLASH_* variables all use these names.
OPTION_FIELDS: dict[str, tuple[str, str]] = {
    "data": ("data", "source"),
    "seq_len": ("data", "seq_len"),
    "batch_size": ("data", "batch_size"),
    "target": ("target", "spec"),
    "target_layers": ("target", "layer_ids"),
    "drafter_layers": ("drafter", "num_layers"),
    "block_size": ("drafter", "block_size"),
    "num_anchors": ("objective", "num_anchors"),
    "loss_decay_gamma": ("objective", "loss_decay_gamma"),
    "use_soft_labels": ("objective", "use_soft_labels"),
    "kl_temperature": ("objective", "kl_temperature"),
    "kl_weight": ("objective", "kl_weight"),
    "streak_alpha": ("objective", "streak_alpha"),
    "lr": ("optim", "lr"),
    "warmup_steps": ("optim", "warmup_steps"),
    "grad_clip": ("optim", "grad_clip"),
    "weight_decay": ("optim", "weight_decay"),
    "steps": ("run", "steps"),
    "seed": ("run", "seed"),
    "output_dir": ("run", "output_dir"),
    "resume": ("run", "resume"),
    "save_every": ("run", "save_every"),
    "eval_prompts": ("run", "eval_prompts"),
    "eval_new_tokens": ("run", "eval_new_tokens"),
    "eval_prompt_tokens": ("run", "eval_prompt_tokens"),
    "debug": ("run", "debug"),
    "target_devices": ("pipeline", "target_devices"),
    "drafter_devices": ("pipeline", "drafter_devices"),
    "batch_queue_size": ("pipeline", "batch_queue_size"),
    "hs_queue_size": ("pipeline", "hs_queue_size"),
    "otlp_endpoint": ("telemetry", "otlp_endpoint"),
    "otlp_protocol": ("telemetry", "otlp_protocol"),
    "trace_level": ("telemetry", "trace_level"),
    "trace_sample_ratio": ("telemetry", "trace_sample_ratio"),
    "trace_file": ("telemetry", "trace_file"),
    "cuda_timing": ("telemetry", "cuda_timing"),
    "profile_interval": ("telemetry", "profile_interval_s"),
    "service_name": ("telemetry", "service_name"),
}


def config_from_options(options: dict[str, Any], base: TrainConfig | None = None) -> TrainConfig:
    """Build a validated config from option-name values (None = keep the base value)."""
    sections: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if value is None:
            continue
        if name not in OPTION_FIELDS:
            raise ConfigError(f"unknown option {name!r}")
        sec, fld = OPTION_FIELDS[name]
        if isinstance(value, list):
            value = tuple(value)
        sections.setdefault(sec, {})[fld] = value
    base = base or TrainConfig()
    updates = {
        sec: dataclasses.replace(getattr(base, sec), **vals) for sec, vals in sections.items()
    }
    return dataclasses.replace(base, **updates)


def option_default(name: str) -> Any:
    """Built-in default of a command-line option (lists joined by commas)."""
    section, fld = OPTION_FIELDS[name]
    value = getattr(getattr(TrainConfig(), section), fld)
    return ",".join(map(str, value)) if isinstance(value, tuple) else value
