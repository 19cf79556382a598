"""τ while training (--eval-every): the drafter as it is at a step decodes the held-out
prompts speculatively, with the code whose τ equals vLLM's (dflash.eval), and the
figures land on that step's metrics.jsonl line, the metrics signal and the progress line.

Training's own τ figures (`tau_estimate`, `tau_chain`) score random anchors of training
rows against the data's next tokens; these decode what the run will be judged on. Their
cost is bounded: by default (--eval-every unset) an evaluation runs at a logged step only
while all of them, the next one included at the last one's cost, stay within
`BUDGET_SHARE` of the training time so far (the first one at a cost estimated from one
prompt's prefill and two decoding cycles, as if no draft were accepted); --eval-every N
evaluates every N steps. The logged steps between them get the serving walk
(dflash.eval.walk: the same greedy decoding replayed from one drafter forward over the
target's continuations, computed once; `walk_tau` equals `eval_tau` up to rounding)
where the same budget leaves room. The last step's evaluation is the final one
(dflash.run.finish.complete_run), never a second measurement. With --keep-best the
weights of the best evaluation are kept, to be saved as OUTPUT_DIR/drafter in place of
the last ones.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

import tracing
from dflash import names
from dflash.config.settings import RunConfig
from dflash.data.datasets import PackedDataset, heldout_prompts
from dflash.drafter.model import DFlashDrafter
from dflash.errors import DFlashError
from dflash.eval.evaluate import evaluate_tau
from dflash.eval.walk import WalkRow, prepare_walk, walk_tau
from dflash.summary import JSON
from dflash.target.model import TargetModel

BUDGET_SHARE = 0.10  # of the training time: what the default's evaluations may cost
WALK_SHARE = 0.5  # of that budget, at most, for serving walks: they never starve decoding
EVAL_KEYS = ("tau", "tau_pooled", "acceptance_per_position", "tau_without_repeats")


def eval_keys(figures: JSON) -> JSON:
    """A final evaluation's figures under the names a metrics.jsonl line gives them."""
    return {f"eval_{key}": figures[key] for key in EVAL_KEYS if figures.get(key) is not None}


@dataclass
class Best:
    step: int
    tau: float
    weights: dict[str, torch.Tensor] | None = None  # trainable weights, on the host


@dataclass
class TrainingEvals:
    """When the run evaluates while training, and what it found (rank 0's replica 0)."""

    cfg: RunConfig
    target: TargetModel
    drafter: DFlashDrafter
    prompts: list[list[int]]
    layer_ids: list[int] = field(default_factory=list)
    history: list[JSON] = field(default_factory=list)
    spent_s: float = 0.0
    walk_spent_s: float = 0.0
    best: Best | None = None
    _last_cost_s: float | None = None  # None until measured or estimated
    _last_walk_s: float = 0.0
    _walk_rows: list[WalkRow] | None = None

    @classmethod
    def for_run(
        cls,
        cfg: RunConfig,
        target: TargetModel,
        drafter: DFlashDrafter,
        heldout: PackedDataset,
        skipped: str | None,
        layer_ids: list[int],
    ) -> TrainingEvals | None:
        """None when the run does not evaluate while training: --eval-every 0, no held-out
        prompts, or an in-process evaluation that cannot run (`skipped`: why)."""
        if skipped is not None and cfg.eval_every:
            raise DFlashError(f"--eval-every {cfg.eval_every}: τ cannot be measured: {skipped}")
        if cfg.eval_every == 0 or cfg.eval_prompts == 0 or skipped is not None:
            return None
        prompts = heldout_prompts(heldout, cfg.eval_prompts, cfg.eval_prompt_tokens)
        return cls(cfg, target, drafter, prompts, list(layer_ids))

    def due(self, step: int, train_s: float) -> bool:
        """Whether to evaluate after `step` (1-based, global), `train_s` seconds into
        training (evaluations included). Never at the last step: that is the final one."""
        if step >= self.cfg.steps:
            return False
        every = self.cfg.eval_every
        if every is not None:
            return step % every == 0
        return self._fits(self._next_cost_s(), train_s)

    def _next_cost_s(self) -> float:
        """The next evaluation's cost: the last one's, or before the first a pessimistic
        estimate (no draft accepted: one target forward per new token), whose own
        measurement counts as spent."""
        if self._last_cost_s is None:
            start_s = time.perf_counter()
            self._last_cost_s = self._estimate_cost_s()
            self.spent_s += time.perf_counter() - start_s
        return self._last_cost_s

    def _estimate_cost_s(self) -> float:
        prompt, new = self.prompts[0], self.cfg.eval_new_tokens
        with torch.no_grad(), self.target.forward_lock:
            times = []
            for tokens in (1, 3):  # the prefill alone, then the prefill and two cycles
                start_s = time.perf_counter()
                evaluate_tau(self.target, self.drafter, [prompt], tokens)
                times.append(time.perf_counter() - start_s)
        cycle_s = max(times[1] - times[0], 0.0) / 2
        return len(self.prompts) * (times[0] + max(new - 1, 0) * cycle_s)

    def _fits(self, cost_s: float, train_s: float) -> bool:
        """Whether what was spent, and `cost_s` more, stays within the budget's share of
        the training proper (`train_s` less the evaluations)."""
        return self.spent_s + cost_s <= BUDGET_SHARE * (train_s - self.spent_s)

    def _walk_fits(self, train_s: float) -> bool:
        """Whether the next walk fits both the whole budget and the walks' share of it."""
        share = WALK_SHARE * BUDGET_SHARE * (train_s - self.spent_s)
        cost_s = self._last_walk_s
        return self._fits(cost_s, train_s) and self.walk_spent_s + cost_s <= share

    def on_logged_step(self, step: int, train_s: float, links: Sequence[object] = ()) -> JSON:
        """The figures a logged step gains: the decoding's when due, else the serving
        walk's where the budget leaves room for it (never at the last step: the final
        evaluation measures it). `links`: to the step's span (tracing.phase's `links`)."""
        if self.due(step, train_s):
            return self.evaluate(step, links)
        if step < self.cfg.steps and self._walk_fits(train_s):
            return self.walk(step, links)
        return {}

    def walk(self, step: int, links: Sequence[object] = ()) -> JSON:
        """The serving walk's τ of the drafter now: walk_* figures of a logged step (the
        target's continuations are computed at the first call, inside its cost)."""
        start_s = time.perf_counter()
        attributes = {names.STEP: step}
        with tracing.phase(names.EVAL_WALK, level="step", attributes=attributes, links=links):
            if self._walk_rows is None:
                with self.target.forward_lock, torch.no_grad():
                    bs = self.drafter.config.block_size
                    new = self.cfg.eval_new_tokens
                    self._walk_rows = prepare_walk(
                        self.target, self.layer_ids, self.prompts, new, bs
                    )
            walk_start_s = time.perf_counter()
            stops = self.target.stop_token_ids
            result = walk_tau(self.drafter, self._walk_rows, self.cfg.eval_new_tokens, stops)
        now_s = time.perf_counter()
        self._last_walk_s = now_s - walk_start_s  # the next walk's cost: without the rows'
        self.spent_s += now_s - start_s
        self.walk_spent_s += now_s - start_s
        return {"walk_tau": result.tau, "walk_tau_pooled": result.tau_pooled}

    def evaluate(self, step: int, links: Sequence[object] = ()) -> JSON:
        """τ of the drafter now: the eval_* figures of `step`'s metrics.jsonl line."""
        start_s = time.perf_counter()
        attributes = {names.STEP: step}
        # The target thread's forwards wait meanwhile: `capture` hooks the same module.
        phase = tracing.phase(names.EVAL, level="step", attributes=attributes, links=links)
        with phase, torch.no_grad(), self.target.forward_lock:
            result = evaluate_tau(self.target, self.drafter, self.prompts, self.cfg.eval_new_tokens)
        cost_s = time.perf_counter() - start_s
        self.spent_s += cost_s
        self._last_cost_s = cost_s
        figures = {
            "eval_tau": float(result.tau),
            "eval_tau_pooled": float(result.tau_pooled),
            "eval_acceptance_per_position": [float(a) for a in result.acceptance_per_position],
            "eval_tau_without_repeats": _float_or_none(result.tau_without_repeats),
            "eval_s": round(cost_s, 4),
        }
        self.record(step, figures)
        return figures

    def record(self, step: int, figures: JSON, final: bool = False) -> None:
        """One evaluation in the history; the best one's weights kept with --keep-best."""
        self.history.append({"step": step, **figures})
        tau = figures.get("eval_tau")
        if tau is None or (self.best is not None and tau <= self.best.tau):
            return
        weights = None
        if self.cfg.keep_best and not final:
            weights = trainable_weights(self.drafter)
        self.best = Best(step, float(tau), weights)

    def summary(self, train_s: float) -> JSON:
        """What summary.json records of the evaluations while training."""
        during = [h for h in self.history if "eval_s" in h]
        share = self.spent_s / train_s if train_s > 0 else None
        out: JSON = {
            "evaluations": len(during),
            "walk_seconds": round(self.walk_spent_s, 3),
            "seconds": round(self.spent_s, 3),
            "share_of_training": None if share is None else round(share, 4),
            "curve": [{"step": h["step"], "tau": h.get("eval_tau")} for h in self.history],
        }
        if self.best is not None:
            out["best_step"], out["best_tau"] = self.best.step, self.best.tau
        return out


def trainable_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of the trainable parameters (what a checkpoint keeps of a drafter)."""
    return {
        name: p.detach().to("cpu", copy=True)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _float_or_none(value: float | None) -> float | None:
    return None if value is None else float(value)
