"""summary.json and the eval JSON as typed records: what a run and `dflash-train eval`
measured, written by dflash.run and dflash.eval and read back by dflash.observe's report.

It sits at the bottom of the layers (beside names.py) so that every package that writes
or reads these files shares one definition. `to_dict()` writes the keys the files have
always had, plus `schema_version`; `from_dict()` reads files of any version (keys a
version did not write read as None, keys this one does not know are kept as they were).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# 1: the first typed summary.json and eval JSON (files before carry no schema_version: 0).
SCHEMA_VERSION = 1

JSON = dict[str, Any]  # a JSON object as json.load gives it: values of any JSON type


def _float(value: object) -> float | None:
    """A number of the file as a float (None: absent, null or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _floats(value: object) -> list[float]:
    if not isinstance(value, list):
        return []
    return [float(v) for v in value if _float(v) is not None]


def _dict(value: object) -> JSON | None:
    return dict(value) if isinstance(value, dict) else None


@dataclass
class HeldOutFigures:
    """The in-process evaluation of a drafter: speculative decoding on held-out prompts
    against greedy decoding with the same KV-cached target."""

    tau: float  # mean over prompts of each prompt's mean acceptance length
    tau_pooled: float  # over all drafting cycles of all prompts
    acceptance_per_position: list[float]  # share of cycles accepting draft k, k = 1..Bs-1
    tokens_per_target_forward: float
    speedup: float | None  # greedy_s / speculative_s; None without the greedy run
    speculative_s: float
    greedy_s: float | None
    repeated_share: float | None  # accepted drafts inside repeated spans (loops), of all
    tau_without_repeats: float | None  # pooled τ of the cycles outside them

    def to_dict(self) -> JSON:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: JSON) -> HeldOutFigures:
        return cls(
            tau=float(data["tau"]),
            tau_pooled=_float(data.get("tau_pooled")) or float(data["tau"]),
            acceptance_per_position=_floats(data.get("acceptance_per_position")),
            tokens_per_target_forward=_float(data.get("tokens_per_target_forward")) or 0.0,
            speedup=_float(data.get("speedup")),
            speculative_s=_float(data.get("speculative_s")) or 0.0,
            greedy_s=_float(data.get("greedy_s")),
            repeated_share=_float(data.get("repeated_share")),
            tau_without_repeats=_float(data.get("tau_without_repeats")),
        )


# Where the served figures come from: `vllm_command` for a run's --eval-engine vllm,
# the others for `dflash-train eval --server`. Written only when set.
_SERVED_CONTEXT = (
    "server",
    "vllm_command",
    "server_model",
    "prompts",
    "max_new_tokens",
    "target",
    "block_size",
)


@dataclass
class ServedFigures:
    """τ as a serving engine measures it, by its own counters (dflash.eval.served)."""

    tau: float | None  # mean of per-prompt τ (None: no prompt finished a draft)
    tau_pooled: float
    acceptance_per_position: list[float]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_speculative_tokens: int
    new_tokens: int
    requests: int
    other_traffic: JSON | None  # the engine's requests and tokens not sent by this eval
    eval_s: float
    server: str | None = None  # "vllm" (a run's engine) or the server's URL (eval)
    vllm_command: str | None = None
    server_model: str | None = None
    prompts: int | None = None
    max_new_tokens: int | None = None
    target: str | None = None
    block_size: int | None = None

    def to_dict(self) -> JSON:
        out = dataclasses.asdict(self)
        for key in _SERVED_CONTEXT:
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, data: JSON) -> ServedFigures:
        return cls(
            tau=_float(data.get("tau")),
            tau_pooled=_float(data.get("tau_pooled")) or 1.0,
            acceptance_per_position=_floats(data.get("acceptance_per_position")),
            num_drafts=_int(data.get("num_drafts")) or 0,
            num_draft_tokens=_int(data.get("num_draft_tokens")) or 0,
            num_accepted_tokens=_int(data.get("num_accepted_tokens")) or 0,
            num_speculative_tokens=_int(data.get("num_speculative_tokens")) or 0,
            new_tokens=_int(data.get("new_tokens")) or 0,
            requests=_int(data.get("requests")) or 0,
            other_traffic=_dict(data.get("other_traffic")),
            eval_s=_float(data.get("eval_s")) or 0.0,
            server=_str(data.get("server")),
            vllm_command=_str(data.get("vllm_command")),
            server_model=_str(data.get("server_model")),
            prompts=_int(data.get("prompts")),
            max_new_tokens=_int(data.get("max_new_tokens")),
            target=_str(data.get("target")),
            block_size=_int(data.get("block_size")),
        )


@dataclass
class Evaluation:
    """The final evaluation of a run: in process (`held_out`), by vLLM (`served`), or
    none (`skipped` says why, when a reason is known)."""

    held_out: HeldOutFigures | None = None
    served: ServedFigures | None = None
    skipped: str | None = None

    @property
    def tau(self) -> float | None:
        if self.held_out is not None:
            return self.held_out.tau
        return self.served.tau if self.served is not None else None

    @property
    def tau_pooled(self) -> float | None:
        if self.held_out is not None:
            return self.held_out.tau_pooled
        return self.served.tau_pooled if self.served is not None else None

    @property
    def acceptance_per_position(self) -> list[float]:
        if self.held_out is not None:
            return self.held_out.acceptance_per_position
        return self.served.acceptance_per_position if self.served is not None else []

    @property
    def speedup(self) -> float | None:
        return self.held_out.speedup if self.held_out is not None else None

    @property
    def repeated_share(self) -> float | None:
        return self.held_out.repeated_share if self.held_out is not None else None

    @property
    def tau_without_repeats(self) -> float | None:
        return self.held_out.tau_without_repeats if self.held_out is not None else None

    def to_dict(self) -> JSON:
        """summary.json's top-level figure keys, as each kind of evaluation wrote them."""
        if self.held_out is not None:
            return self.held_out.to_dict()
        if self.served is not None:
            served = self.served
            return {
                "tau": served.tau,
                "tau_pooled": served.tau_pooled,
                "acceptance_per_position": served.acceptance_per_position,
                "speedup": None,
                "served": served.to_dict(),
            }
        return (
            {"tau": None} if self.skipped is None else {"tau": None, "eval_skipped": self.skipped}
        )

    @classmethod
    def from_dict(cls, data: JSON) -> Evaluation:
        served = _dict(data.get("served"))
        if served is not None:
            return cls(served=ServedFigures.from_dict(served))
        if _float(data.get("tau")) is not None:
            return cls(held_out=HeldOutFigures.from_dict(data))
        return cls(skipped=_str(data.get("eval_skipped")))


# The eval JSON's keys beside the figures: the settings that produced them.
_EVAL_CONTEXT = (
    "prompts",
    "turns",
    "new_tokens",
    "max_new_tokens",
    "temperature",
    "draft_sampling",
    "block_size",
    "target",
    "dtype",
    "eval_s",
)


@dataclass
class EvalRecord:
    """The eval JSON (`dflash-train eval --json`): the in-process figures with the
    settings that produced them (`held_out`), the engine's (`served`, with `--server`),
    or both. The figures of whichever ran sit at the top level, as they always have."""

    held_out: HeldOutFigures | None = None
    served: ServedFigures | None = None
    prompts: int | None = None
    turns: int | None = None  # the prompts plus the later turns of {"turns": [...]} lines
    new_tokens: int | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    draft_sampling: str | None = None
    block_size: int | None = None
    target: str | None = None
    dtype: str | None = None  # the target's and the drafter's, in process
    eval_s: float | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def tau_pooled(self) -> float | None:
        if self.held_out is not None:
            return self.held_out.tau_pooled
        return self.served.tau_pooled if self.served is not None else None

    def to_dict(self) -> JSON:
        out: JSON = {"schema_version": self.schema_version}
        if self.held_out is not None:
            out.update(self.held_out.to_dict())
            out.update({key: getattr(self, key) for key in _EVAL_CONTEXT})
        elif self.served is not None:
            out.update(self.served.to_dict())
        if self.served is not None:
            out["served"] = self.served.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: JSON) -> EvalRecord:
        """An eval JSON of any version; raises TypeError when `data` is not an object."""
        if not isinstance(data, dict):
            raise TypeError(f"the eval JSON holds {type(data).__name__}, not an object")
        served = _dict(data.get("served"))
        # speculative_s is the in-process evaluation's own key: the engine has no such clock.
        in_process = _float(data.get("tau")) is not None and "speculative_s" in data
        return cls(
            held_out=HeldOutFigures.from_dict(data) if in_process else None,
            served=ServedFigures.from_dict(served) if served is not None else None,
            prompts=_int(data.get("prompts")),
            turns=_int(data.get("turns")),
            new_tokens=_int(data.get("new_tokens")),
            max_new_tokens=_int(data.get("max_new_tokens")),
            temperature=_float(data.get("temperature")),
            draft_sampling=_str(data.get("draft_sampling")),
            block_size=_int(data.get("block_size")),
            target=_str(data.get("target")),
            dtype=_str(data.get("dtype")),
            eval_s=_float(data.get("eval_s")),
            schema_version=_int(data.get("schema_version")) or 0,
        )


# summary.json's keys, in the order they are written; the evaluation's figures go after
# final_loss, the keys of `extra` (unknown to this version) last.
_HEAD = ("steps", "steps_this_run", "tokens_per_s", "final_loss")
_RUN = (
    "wall_s",
    "train_s",
    "setup_s",
    "eval_s",
    "bad_steps",
    "block_size",
    "target",
    "target_layer_ids",
    "mask_token_id",
    "mask_token_source",
    "packing",
    "initialized_from",
    "drafter_dir",
    "tau_estimate",
)
_EVALUATION_KEYS = (
    *(f.name for f in dataclasses.fields(HeldOutFigures)),
    "served",
    "eval_skipped",
)


@dataclass
class Summary:
    """summary.json: one run's figures, finished or interrupted (`interrupted` says where).

    Fields a file did not hold (an older version, an interrupted run) read as None."""

    steps: int | None = None  # the run's step count, resumed steps included
    steps_this_run: int | None = None
    tokens_per_s: float | None = None  # training tokens per second of training time
    final_loss: float | None = None  # None: no finished step, or a non-finite loss
    evaluation: Evaluation = field(default_factory=Evaluation)
    # dflash.run.evaluations' record of the evaluations while training
    evaluations_while_training: JSON | None = None
    drafter_step: int | None = None  # --keep-best: the step whose drafter OUTPUT_DIR holds
    wall_s: float | None = None
    train_s: float | None = None
    setup_s: float | None = None
    eval_s: float | None = None
    bad_steps: int | None = None  # non-finite steps skipped (no update)
    block_size: int | None = None
    target: str | None = None
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    mask_token_source: str | None = None
    packing: str | None = None
    initialized_from: str | None = None
    drafter_dir: str | None = None  # None: the final drafter was not saved
    tau_estimate: float | None = None  # training's τ estimate at the last logged step
    hidden_cache_skipped: dict[str, int] | None = None  # per-sample files skipped, by why
    # What else the run's feature source records (dflash.run.features: summary()).
    feature_source: JSON = field(default_factory=dict)
    interrupted: str | None = None  # the signal, or where the run stopped
    pipeline: JSON | None = None  # the pipeline's devices, rates and queue depths
    # The bottleneck verdict; written (possibly null) whenever `telemetry` is.
    verdict: str | None = None
    telemetry: JSON | None = None  # the span/metric exporters' counters and `files`
    extra: JSON = field(default_factory=dict)  # keys this version does not know
    schema_version: int = SCHEMA_VERSION

    # --- the figures read most, by name
    @property
    def tau(self) -> float | None:
        return self.evaluation.tau

    @property
    def tau_pooled(self) -> float | None:
        return self.evaluation.tau_pooled

    @property
    def acceptance_per_position(self) -> list[float]:
        return self.evaluation.acceptance_per_position

    @property
    def speedup(self) -> float | None:
        return self.evaluation.speedup

    @property
    def timeline_file(self) -> str | None:
        """Where `--timeline` wrote the run's timeline (telemetry.files.timeline)."""
        files = (self.telemetry or {}).get("files")
        return _str(files.get("timeline")) if isinstance(files, dict) else None

    def to_dict(self) -> JSON:
        out: JSON = {"schema_version": self.schema_version}
        out.update({key: getattr(self, key) for key in _HEAD})
        out.update(self.evaluation.to_dict())
        if self.evaluations_while_training is not None:
            out["evaluations_while_training"] = self.evaluations_while_training
            if self.drafter_step is not None:
                out["drafter_step"] = self.drafter_step
        out.update({key: getattr(self, key) for key in _RUN})
        if self.hidden_cache_skipped is not None:
            out["hidden_cache_skipped"] = self.hidden_cache_skipped
        out.update(self.feature_source)
        if self.interrupted is not None:
            out["interrupted"] = self.interrupted
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        if self.telemetry is not None:
            out["verdict"] = self.verdict
            out["telemetry"] = self.telemetry
        elif self.verdict is not None:
            out["verdict"] = self.verdict
        return {**out, **self.extra}

    @classmethod
    def from_dict(cls, data: JSON) -> Summary:
        """A summary.json of any version; raises TypeError when `data` is not an object."""
        if not isinstance(data, dict):
            raise TypeError(f"summary.json holds {type(data).__name__}, not an object")
        layer_ids = data.get("target_layer_ids")
        skipped = _dict(data.get("hidden_cache_skipped"))
        known = {"schema_version", *_HEAD, *_RUN, *_EVALUATION_KEYS}
        known |= {"evaluations_while_training", "drafter_step", "hidden_cache_skipped"}
        known |= {"interrupted", "pipeline", "verdict", "telemetry"}
        return cls(
            schema_version=_int(data.get("schema_version")) or 0,
            steps=_int(data.get("steps")),
            steps_this_run=_int(data.get("steps_this_run")),
            tokens_per_s=_float(data.get("tokens_per_s")),
            final_loss=_float(data.get("final_loss")),
            evaluation=Evaluation.from_dict(data),
            evaluations_while_training=_dict(data.get("evaluations_while_training")),
            drafter_step=_int(data.get("drafter_step")),
            wall_s=_float(data.get("wall_s")),
            train_s=_float(data.get("train_s")),
            setup_s=_float(data.get("setup_s")),
            eval_s=_float(data.get("eval_s")),
            bad_steps=_int(data.get("bad_steps")),
            block_size=_int(data.get("block_size")),
            target=_str(data.get("target")),
            target_layer_ids=[int(i) for i in layer_ids] if isinstance(layer_ids, list) else None,
            mask_token_id=_int(data.get("mask_token_id")),
            mask_token_source=_str(data.get("mask_token_source")),
            packing=_str(data.get("packing")),
            initialized_from=_str(data.get("initialized_from")),
            drafter_dir=_str(data.get("drafter_dir")),
            tau_estimate=_float(data.get("tau_estimate")),
            hidden_cache_skipped=None
            if skipped is None
            else {k: int(v) for k, v in skipped.items()},
            interrupted=_str(data.get("interrupted")),
            pipeline=_dict(data.get("pipeline")),
            verdict=_str(data.get("verdict")),
            telemetry=_dict(data.get("telemetry")),
            extra={k: v for k, v in data.items() if k not in known},
        )
