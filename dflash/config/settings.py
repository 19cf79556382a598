"""One typed settings tree for a training run, and everything derived from it.

Every setting is declared once, as a field of a section dataclass:

    seq_len: int = setting(128, "Tokens per packed row.", min=8)

Its type (`Literal` for choices, `| None` when it may stay unset), default, range and
help line are all that the command line (`--seq-len`), the environment
(`DFLASH_SEQ_LEN`), `--config` files (flat `seq_len:` / `seq-len:` or sectioned
`data: {seq_len: ...}`) and the saved OUTPUT_DIR/config.json need: `options()` derives
them. Each section validates itself in `__post_init__` and names the flag to change,
so the Python API and the command line reject the same values with the same line.
config.json records the run, not one invocation: the fields declared with
`invocation=True` (`--overwrite`, `--resume`, ...) are not saved, and a config file's
value of one is left out.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from dflash.config import checks
from dflash.config.schema import (
    ConfigError,
    FileValues,
    Json,
    Option,
    Schema,
    Section,
    Value,
    setting,
)
from dflash.summary import JSON

# Bump when a saved config.json can no longer be read as it was written.
SCHEMA_VERSION = 1


DEFAULT_DPACE_ALPHA = 0.5  # D-PACE's α (arXiv 2605.18810: stable over 0.3-0.7)

# (block size, γ) points from the DFlash paper; other sizes interpolate linearly.
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """Loss decay γ by block size: 4 for 8, 5 for 10, 7 for 16, linear in between.

    Outside [8, 16] the nearest segment's slope is extended (floored at 1).
    """
    pts = _GAMMA_POINTS
    (x0, y0), (x1, y1) = (pts[0], pts[1]) if block_size <= pts[1][0] else (pts[1], pts[2])
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


# ----------------------------------------------------------------- the sections


@dataclass(frozen=True)
class DataConfig(Section):
    """Where training text comes from and how it is cut into rows."""

    source: str = setting(
        "embedded",
        "Training text: `embedded` (the target's own continuations of prefixes of the Python "
        "standard library source, generated once and cached), `embedded-corpus` (that source "
        "as it is), a text file, a folder, or JSONL with a `text` field or chat `messages` "
        "(loss on assistant turns only).",
        option="data",
        check=checks.not_blank,
    )
    seq_len: int = setting(128, "Tokens per packed row.", min=8)
    batch_size: int = setting(4, "Packed rows per training batch.", min=1)
    heldout_fraction: float = setting(
        0.05, "Share of documents kept out of training for evaluation.", gt=0.0, lt=1.0
    )
    keep_cut_replies: bool = setting(
        False,
        "Train on conversations with a reply `regenerate` cut at --max-new-tokens (marked "
        "in its output); by default they are left out and counted.",
    )
    max_dropped_share: float = setting(
        0.5,
        "Stop before training when packing drops more than this share of the conversations "
        "(their first reply does not fit --seq-len): a run on the few left would report "
        "success having learned little.",
        min=0.0,
        max=1.0,
    )
    chat_rendering: Literal["whole", "per-turn"] = setting(
        "whole",
        "How a chat becomes training tokens: `whole` renders the conversation once and "
        "learns each reply where it stands in it; `per-turn` makes each reply a document of "
        "its own after the prompt a server gives for it (the template on the turns before it "
        "with the generation prompt and --chat-template-kwargs: a non-thinking Qwen3's empty "
        "think block before every reply).",
    )
    packing: Literal["docs", "concat"] = setting(
        "docs",
        "How documents fill rows: `docs` keeps each document to itself (the target, the "
        "anchors and every block's context stay inside it; chats are cut at turn ends), "
        "`concat` cuts rows from the concatenated stream.",
    )
    hidden_cache: str | None = setting(
        None,
        "Train from this offline hidden-state cache instead of running the target forward: "
        "a batch cache of `dflash-train cache-hidden` (same target, layers and data options), "
        "or per-sample hs_*.safetensors files in speculators' layout (from vLLM through "
        "speculators, or `cache-hidden --format speculators`), whose samples are the rows.",
        check=checks.not_blank,
    )
    strict_cache: bool = setting(
        False,
        "Stop at a missing, truncated or non-finite hidden-state sample instead of leaving "
        "it out and counting it.",
    )


@dataclass(frozen=True)
class TargetConfig(Section):
    """The frozen target model and which of its layers feed the drafter."""

    spec: str = setting(
        "builtin:tiny",
        "Target model: `builtin:tiny`, a local Hugging Face directory or a hub id.",
        option="target",
        check=checks.not_blank,
    )
    layer_ids: tuple[int, ...] | None = setting(
        None,
        "Comma-separated 0-based target layer ids to capture, ascending and each once (the "
        "order vLLM and SGLang concatenate them in); unset spreads as many as "
        "--drafter-layers evenly from layer 1 to L-3 (wider on a shallow target).",
        option="target_layers",
        check=checks.layer_ids,
    )
    chat_template_kwargs: str | None = setting(
        None,
        "JSON object of chat-template arguments (e.g. '{\"enable_thinking\": false}' for a "
        "non-thinking Qwen3 drafter), given to every rendering of a conversation: training "
        "data, regeneration and evaluation prompts. Saved with the drafter; `eval` uses the "
        "drafter's unless given.",
        check=checks.json_object,
    )

    engine: Literal["in-process", "vllm"] = setting(
        "in-process",
        "What computes the target's hidden states while training: `in-process` (the target "
        "runs in the run's target stage), or `vllm`: a vLLM engine run by --vllm-python "
        "(tools/vllm/extract_hidden_states.py) writes them into a spool of at most "
        "--spool-size bytes, in the order training reads them; --packing docs.",
        option="target_engine",
    )
    vllm_python: str | None = setting(
        None,
        "With --target-engine vllm: the python that has vLLM (`bash tools/vllm/venv.sh` "
        "prints its CPU build's).",
        check=checks.not_blank,
    )
    engine_args: str | None = setting(
        None,
        "With --target-engine vllm: vLLM engine arguments, as one string (e.g. "
        "'--tensor-parallel-size 8').",
    )
    spool_dir: str | None = setting(
        None,
        "With --target-engine vllm: the spool's folder (default OUTPUT_DIR/spool); one run "
        "at a time.",
        check=checks.not_blank,
    )
    spool_size: str = setting(
        "2GiB",
        "With --target-engine vllm: the most bytes of hidden states the spool holds (2GiB, "
        "500MB, ...); the engine waits while it is full. At least two samples of --seq-len.",
        check=checks.byte_size,
    )

    @property
    def parsed_chat_template_kwargs(self) -> JSON:
        """--chat-template-kwargs as the mapping the chat template is given."""
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}


@dataclass(frozen=True)
class DrafterShapeConfig(Section):
    """Shape of the drafter that is trained, and where its weights start (not
    dflash.drafter.DrafterConfig: the model's own, with the target's sizes)."""

    num_layers: int = setting(
        1, "Number of drafter decoder layers.", option="drafter_layers", min=1
    )
    block_size: int = setting(
        8, "Tokens per drafted block (the anchor plus BLOCK_SIZE-1 predictions).", min=2
    )
    intermediate_size: int | None = setting(
        None,
        "Width of the drafter's MLP; unset uses the target's intermediate size.",
        option="drafter_intermediate_size",
        min=1,
    )
    mask_token_id: int | None = setting(
        None,
        "Embedding row of the target used for masked block positions; unset takes the "
        "tokenizer's mask token, else the first embedding row past the tokenizer's vocabulary, "
        "else the first special token the data never uses. Must be a token the data never uses.",
        min=0,
    )
    draft_vocab_size: int | None = setting(
        None,
        "Tokens the drafter can propose: the N most frequent target tokens of the training "
        "labels (the mask and stop tokens always in), with a frozen head of their rows and "
        "the d2t/t2d mappings vLLM and speculators read; unset uses the whole vocabulary.",
        min=1,
    )
    init: Literal["random", "target"] = setting(
        "random",
        "How the drafter's weights start: `random`, or `target`: its layers as the target's "
        "last DRAFTER_LAYERS decoder layers, its final norm the target's, the fusion passing "
        "the deepest --target-layers layer through (learns faster from little data; "
        "docs/training.md). A resumed run continues its checkpoint.",
        option="drafter_init",
    )


@dataclass(frozen=True)
class LossConfig(Section):
    """Anchors and the weighted loss (docs/design.md §4); dflash.objective reads it."""

    num_anchors: int = setting(16, "Anchors (blocks) sampled per sequence in each step.", min=1)
    gamma: float | None = setting(
        None,
        "γ of the position weight exp(-(k-1)/γ); unset picks it from the block size "
        "(4 for 8, 5 for 10, 7 for 16), or turns the decay off under D-PACE or streak "
        "weights.",
        option="loss_decay_gamma",
        gt=0.0,
    )
    use_soft_labels: bool = setting(
        False,
        "Also distill from the target's distribution (KL), not only hard labels; the "
        "target sends its final-norm states and the frozen LM head makes the logits.",
    )
    kl_temperature: float = setting(1.0, "Softmax temperature of the distillation KL.", gt=0.0)
    kl_weight: float = setting(
        0.5, "Share of the KL term in the loss when soft labels are on.", min=0.0, max=1.0
    )
    position_weighting: Literal["decay", "dpace"] = setting(
        "decay",
        "How block positions weigh in the loss: `decay`, exp(-(k-1)/γ) normalized by the "
        "weights' sum (the DFlash paper); `dpace`, the drafter's own smoothed confidence "
        "prefix products summed over the positions after (D-PACE, arXiv 2605.18810, Eq. 7-8: "
        "each position weighs what it adds to the expected accepted length), normalized by "
        "the number of scored blocks so that the weights' mass stays in the loss.",
    )
    dpace_alpha: float | None = setting(
        None,
        "D-PACE's smoothing α of the confidences, q~ = (1-α)q + α (Eq. 7); unset: 0.5, the "
        "paper's value (stable over 0.3-0.7). Needs --position-weighting dpace.",
        gt=0.0,
        max=1.0,
    )
    streak_alpha: float | None = setting(
        None,
        "D-PACE's weights normalized by their own sum instead of the number of scored blocks "
        "(this project's first form of them, kept to compare the two normalizations); α as "
        "--dpace-alpha; unset turns it off.",
        min=0.0,
        max=1.0,
    )
    noise_schedule: str = setting(
        "all",
        "Which non-anchor block positions are masked: `all` (the paper's choice), or "
        "`linear:START:END`, the masked share going from START to END (in (0, 1]) over the "
        "run's --steps; only masked positions are scored.",
        check=checks.noise_spec,
    )
    loss_chunk_size: int = setting(
        64,
        "Blocks per chunk of the LM head and loss. With more blocks in a micro-batch, each "
        "chunk is recomputed in the backward, so the loss's memory stays at LOSS_CHUNK_SIZE x "
        "block size x vocabulary fp32 logits whatever the anchor count.",
        min=1,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.position_weighting == "dpace" and self.streak_alpha is not None:
            raise ConfigError(
                f"--streak-alpha {self.streak_alpha:g} is invalid with --position-weighting "
                "dpace: give one of them (--dpace-alpha sets D-PACE's α)"
            )
        if self.dpace_alpha is not None and self.position_weighting != "dpace":
            raise ConfigError(
                f"--dpace-alpha {self.dpace_alpha:g} needs --position-weighting dpace"
            )

    @property
    def confidence_alpha(self) -> float | None:
        """α of the confidence-based (D-PACE) weights in force; None under the decay."""
        if self.position_weighting == "dpace":
            return DEFAULT_DPACE_ALPHA if self.dpace_alpha is None else self.dpace_alpha
        return self.streak_alpha

    @property
    def per_block_normalization(self) -> bool:
        """True: the loss is divided by the number of scored blocks (D-PACE, as its
        authors do), else by the sum of the position weights."""
        return self.position_weighting == "dpace"

    def decay_gamma(self, block_size: int) -> float | None:
        """The γ of the exp decay in force: the one set; else None when D-PACE (or streak)
        weights replace the decay (they already decay over block positions, as in the
        reference trainers); else the paper's value for the block size."""
        if self.gamma is not None:
            return self.gamma
        return None if self.confidence_alpha is not None else default_gamma(block_size)


@dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW with a cosine schedule after a linear warmup, and how one step is computed."""

    lr: float = setting(2e-3, "Peak learning rate of AdamW, reached after the warmup.", gt=0.0)
    warmup_steps: int = setting(
        20, "Steps of linear learning-rate warmup before the cosine decay.", min=0
    )
    grad_clip: float = setting(
        1.0, "Clip the global gradient norm to this value; 0 disables clipping.", min=0.0
    )
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay.", min=0.0)
    min_lr_ratio: float = setting(
        0.1, "The cosine ends at MIN_LR_RATIO times the peak learning rate.", min=0.0, max=1.0
    )
    grad_accum: int = setting(
        1,
        "Micro-batches per optimizer step: each batch holds GRAD_ACCUM x --batch-size rows, "
        "the drafter trains on --batch-size rows at a time and steps once (exact: the same "
        "loss and update as one batch of all rows).",
        min=1,
    )
    activation_checkpointing: bool = setting(
        False,
        "Recompute each drafter layer in the backward instead of keeping its activations "
        "(about a third more drafter compute, far less memory); works with every other option.",
    )
    max_bad_steps: int = setting(
        10,
        "Steps whose loss or gradient norm is not finite are skipped (no update) and counted; "
        "after this many in a row the run stops, keeping its last good checkpoint. Checked "
        "on logged steps (--log-every) and before every checkpoint.",
        min=1,
    )


@dataclass(frozen=True)
class RunConfig(Section):
    """Length, seed, outputs, logging and evaluation of one run."""

    steps: int = setting(
        3000, "Number of optimizer steps to train, counted from step 0 (also when resuming).", min=1
    )
    seed: int = setting(0, "Seed of the data order, anchor sampling and drafter initialization.")
    output_dir: str = setting(
        "runs/default",
        "Directory for the final drafter (drafter/), checkpoints (checkpoints/), config.json, "
        "metrics.jsonl and summary.json.",
        check=checks.not_blank,
    )
    resume: str | None = setting(
        None,
        "Continue from a checkpoint directory, or `latest` for the newest one under "
        "OUTPUT_DIR/checkpoints.",
        invocation=True,
    )
    allow_data_change: bool = setting(
        False,
        "With --resume, continue on other data (another --data, --seq-len, --batch-size, "
        "--heldout-fraction or --packing, or changed file contents): batches from the resumed "
        "step on come from the new data. Without it such a resume is refused.",
        invocation=True,
    )
    overwrite: bool = setting(
        False,
        "Replace the earlier run that OUTPUT_DIR holds (its config, metrics, checkpoints, "
        "drafter, summary and report are deleted once this run has passed its checks); "
        "without it such a folder is refused unless --resume continues the run.",
        invocation=True,
    )
    init_from: str | None = setting(
        None,
        "Start the drafter from the weights of a DFlash drafter directory (a published "
        "drafter, OUTPUT_DIR/drafter of an earlier run, or a checkpoint's drafter/); its "
        "geometry must fit this run. With --resume the checkpoint's weights win.",
        check=checks.not_blank,
    )
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "Precision of the final OUTPUT_DIR/drafter weights; `auto`: the target's (bf16 for a "
        "target run in bf16, as the published drafters). Checkpoints keep the training "
        "precision, so a resume is exact.",
    )
    save_every: int = setting(
        0, "Write a checkpoint every this many steps (0: only at the end).", min=0
    )
    keep_checkpoints: int = setting(3, "Newest checkpoints kept; older ones are deleted.", min=1)
    log_every: int = setting(
        10,
        "Read the step metrics (loss, accuracy per position, τ estimate, gradient norm) from "
        "the device every this many steps: progress line, span attributes, metrics.jsonl.",
        min=1,
    )
    eval_prompts: int = setting(
        8, "Held-out prompts on which τ is measured at the end (0 skips evaluation).", min=0
    )
    eval_every: int | None = setting(
        None,
        "Also measure τ on the held-out prompts every this many steps while training (the "
        "drafter as it is, decoding as at the end; metrics.jsonl's eval_* figures, the τ "
        "curve of report.html). Unset: at logged steps while these evaluations cost at most "
        "10% of the training time; 0: only at the end.",
        min=0,
    )
    keep_best: bool = setting(
        False,
        "Save as OUTPUT_DIR/drafter the drafter of the evaluation with the highest τ (during "
        "training or the final one); the last weights stay in the final checkpoint, and "
        "summary.json names the best step. Needs evaluations while training.",
    )
    eval_new_tokens: int = setting(64, "Tokens generated per evaluation prompt.", min=1)
    eval_dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto",
        "Dtype the target decodes in for τ while training and at the end: `auto`, the one "
        "it trains in; give the dtype the engine will serve it in (a second copy of the "
        "target is loaded when they differ): greedy replies differ between bf16 and fp32, "
        "and τ with them.",
    )
    eval_prompt_tokens: int = setting(64, "Length of each evaluation prompt, in tokens.", min=1)
    eval_engine: Literal["in-process", "vllm"] = setting(
        "in-process",
        "Where the final τ is measured: `in-process` (KV-cached target and drafter, with the "
        "speedup against greedy decoding), or `vllm`: the saved drafter served beside the "
        "target by --vllm-command on loopback, τ read from the engine's own counters as "
        "`eval --server` reads them.",
    )
    vllm_command: str = setting(
        "vllm serve",
        "With --eval-engine vllm: the command that starts vLLM's OpenAI server; --model, "
        "--host, --port and --speculative-config are added (vLLM's CPU build: "
        "`PYTHON -m vllm.entrypoints.openai.api_server`; add flags such as "
        "--gpu-memory-utilization here).",
    )
    debug: bool = setting(
        False, "Show full tracebacks instead of one-line errors.", invocation=True
    )
    allow_over_memory: bool = setting(
        False,
        "Start even when the estimated peak memory of a step (see --dry-run) exceeds the "
        "drafter device's memory (the host's RAM on a CPU); without it such a run is refused "
        "before any model loads.",
        invocation=True,
    )
    dry_run: bool = setting(
        False,
        "Print the estimated peak memory and FLOPs of one optimizer step and exit, "
        "without loading any weights (a hub target's config.json may be fetched).",
        invocation=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        every = self.eval_every
        if every and self.eval_prompts == 0:
            raise ConfigError(f"--eval-every {every} needs held-out prompts (--eval-prompts is 0)")
        if every and every > self.steps:
            raise ConfigError(
                f"--eval-every {every} is invalid: larger than --steps {self.steps} (the final "
                "evaluation measures the last step)"
            )
        if self.keep_best and (every == 0 or self.eval_prompts == 0):
            raise ConfigError(
                "--keep-best needs evaluations while training (--eval-every is 0 or "
                "--eval-prompts is 0)"
            )

    def checkpoint_due(self, step: int) -> bool:
        """Whether the loop writes a checkpoint after `step` (1-based): every --save-every
        steps, except the last step, whose checkpoint the end of the run writes."""
        every = self.save_every
        return bool(every) and step % every == 0 and step < self.steps


@dataclass(frozen=True)
class PipelineConfig(Section):
    """Devices and queue sizes of the producer-consumer pipeline (docs/design.md §3)."""

    target_devices: tuple[str, ...] = setting(
        ("auto",),
        "Comma-separated devices running the target (cpu, cuda:0, ...); `auto`: cpu without "
        "GPUs, else the first half of this rank's GPUs (one GPU serves both sides).",
        check=checks.device_list,
    )
    drafter_devices: tuple[str, ...] = setting(
        ("auto",),
        "Comma-separated devices training drafter replicas; `auto`: cpu without GPUs, else "
        "the second half of this rank's GPUs.",
        check=checks.device_list,
    )
    shard_drafter: bool = setting(
        False,
        "Under torchrun with 2+ ranks: shard the drafter's weights, gradients and AdamW "
        "state across the ranks with FSDP2 (one drafter device per rank) instead of "
        "keeping a whole copy per rank; --dry-run shows the memory of both.",
    )
    batch_queue_size: int = setting(4, "Batches prefetched ahead of the target threads.", min=1)
    hs_queue_size: int = setting(
        2, "Hidden-state batches buffered between target and drafter threads.", min=1
    )
    precision: Literal["auto", "fp32", "bf16"] = setting(
        "auto",
        "Arithmetic of the models: `bf16` runs the drafter's forward under bf16 autocast and "
        "the frozen target in bf16 (the drafter's weights, AdamW's state and the loss's "
        "softmax stay fp32); `fp32` runs everything in fp32; `auto`: bf16 on CUDA, and on a "
        "CPU with native bf16 (AVX512-BF16 or AMX) for models of hidden size 512 or more "
        "(narrower ones gain nothing), else fp32. The start-up line says which and why.",
    )


@dataclass(frozen=True)
class TelemetryConfig(Section):
    """Tracing and interval tables (docs/design.md §5, docs/observability.md); dflash.observe
    reads it."""

    otlp_endpoint: str | None = setting(
        None,
        "OTLP collector URL, http(s)://host[:port] (e.g. http://localhost:4318); unset uses "
        "OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else sends nothing over the network.",
        check=checks.endpoint,
    )
    otlp_protocol: Literal["grpc", "http"] | None = setting(
        None,
        "OTLP transport: grpc (port 4317) or http/protobuf (port 4318); unset uses "
        "OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else http/protobuf (the OTel specification's).",
    )
    trace_level: Literal["off", "step", "phase"] = setting(
        "phase", "Spans exported: none, one per batch and drafter step, or every phase."
    )
    trace_sample_ratio: float | None = setting(
        None,
        "Share of batch traces exported; interval tables always count every phase. "
        "Unset uses OTEL_TRACES_SAMPLER[_ARG], else 1.0.",
        min=0.0,
        max=1.0,
    )
    trace_file: str | None = setting(
        None, "Also write spans to this file as OTLP JSON, one request per line (Jaeger loads it)."
    )
    cuda_timing: Literal["off", "sync", "events"] = setting(
        "off",
        "Device timing of phases: host wall time, synchronize at phase ends, or CUDA events.",
    )
    profile_interval_s: float = setting(
        30.0, "Seconds between interval tables in the log.", option="profile_interval", gt=0.0
    )
    service_name: str | None = setting(
        None,
        "OpenTelemetry service.name; unset uses OTEL_SERVICE_NAME or "
        "OTEL_RESOURCE_ATTRIBUTES, else dflash-train.",
    )
    timeline: str | None = setting(
        None,
        "Chrome/Perfetto trace-event timeline of every phase (open in ui.perfetto.dev); rank N "
        "writes FILE.rankN. Unset: OUTPUT_DIR/timeline.json with the run's first "
        "events (what report.html shows); `off`: none.",
        check=checks.not_blank,
    )
    nvtx: bool = setting(
        False, "NVTX range on every phase, for Nsight Systems (CUDA only; elsewhere a note)."
    )
    torch_profile: str | None = setting(
        None,
        "Record torch.profiler for steps START:STOP (0-based, STOP excluded, e.g. 200:205) "
        "into OUTPUT_DIR/profile/; the steps' spans carry the file's path.",
        check=checks.step_range,
    )
    report_to: tuple[str, ...] = setting(
        (),
        "Also send the run's figures (every metrics.jsonl line, eval_* included), config and "
        "τ curve to these tools, through each one's own library: tensorboard "
        "(OUTPUT_DIR/tensorboard/), mlflow (MLFLOW_TRACKING_URI; also the drafter, "
        "report.html and, to a tracking server, the traces), wandb (WANDB_PROJECT; offline "
        "without network). Comma-separated or repeated; pip install 'dflash-train[trackers]' "
        "installs all three (docs/observability.md).",
        check=checks.report_tools,
        repeatable=True,
    )


@dataclass(frozen=True)
class TrainConfig:
    """The whole run: one section per component; `to_dict` is OUTPUT_DIR/config.json."""

    data: DataConfig = field(default_factory=DataConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterShapeConfig = field(default_factory=DrafterShapeConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def __post_init__(self) -> None:
        if self.drafter.init == "target" and self.run.init_from is not None:
            raise ConfigError(
                f"--drafter-init target and --init-from {self.run.init_from} both say where "
                "the drafter starts: give one"
            )
        block, seq = self.drafter.block_size, self.data.seq_len
        if block > seq:
            raise ConfigError(
                f"--block-size {block} is invalid: longer than a row (--seq-len {seq})"
            )

    @property
    def gamma(self) -> float | None:
        """The loss decay γ actually used (None: streak weights replace the decay)."""
        return self.loss.decay_gamma(self.drafter.block_size)

    def to_dict(self) -> JSON:
        """Plain JSON-able dict (tuples become lists); `from_dict` reads it back. It records
        the run, not one invocation: the invocation flags (`--overwrite`, `--resume`, ...)
        are not in it."""
        out: JSON = {"schema_version": SCHEMA_VERSION}
        for opt in options():
            if opt.spec.invocation:
                continue
            value = getattr(getattr(self, opt.section), opt.field)
            out.setdefault(opt.section, {})[opt.field] = (
                list(value) if isinstance(value, tuple) else value
            )
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Json], source: str = "config") -> TrainConfig:
        """Inverse of `to_dict`; also reads flat option names (see `read_values`), and
        leaves out the invocation flags an older config.json holds."""
        return config_from_options(read_values(raw, source).values)


SECTIONS: dict[str, type[Section]] = {
    # (mypy ignore below) every section field's default_factory is its class
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(TrainConfig)
}
TRAIN = Schema(SECTIONS)


def options() -> tuple[Option, ...]:
    """Every setting of a training run, section by section, in declaration order."""
    return TRAIN.options


def option_map() -> dict[str, Option]:
    return TRAIN.by_name


def option_default(name: str) -> Value:
    """Built-in default of a command-line option (lists joined by commas)."""
    value = option_map()[name].default
    return ",".join(map(str, value)) if isinstance(value, tuple) else value


def config_from_options(
    options_: Mapping[str, Value], base: TrainConfig | None = None
) -> TrainConfig:
    """A validated config from flat option values (None keeps the base value)."""
    known = option_map()
    sections: dict[str, dict[str, Value]] = {}
    for name, value in options_.items():
        if value is None:
            continue
        if name not in known:
            raise ConfigError(f"unknown option {name!r}")
        opt = known[name]
        sections.setdefault(opt.section, {})[opt.field] = (
            tuple(value) if isinstance(value, list) else value
        )
    base = base or TrainConfig()
    updates = {
        sec: dataclasses.replace(getattr(base, sec), **vals) for sec, vals in sections.items()
    }
    return dataclasses.replace(base, **updates)


def read_values(raw: Mapping[str, Json], source: str) -> FileValues:
    """What a config file's mapping sets (flat option names, or sections as in
    config.json); unknown sections or keys, a wrong type or an incompatible
    `schema_version` are one ConfigError naming key and file."""
    version = raw.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ConfigError(
            f"{source}: key 'schema_version' is {version!r}; this dflash-train reads "
            f"version {SCHEMA_VERSION}"
        )
    return TRAIN.read({k: v for k, v in raw.items() if k != "schema_version"}, source)


def values_from_mapping(raw: Mapping[str, Json], source: str) -> dict[str, Value]:
    """The option values of `read_values` (invocation flags left out)."""
    return read_values(raw, source).values
