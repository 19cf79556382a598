"""Step metrics read from the device once every --log-every steps.

A training step leaves its loss, accuracies and gradient norm as device tensors
(dflash.train.step); reading one back stalls the device stream, so `StepMetrics.read`
does it for the logged steps only, in one transfer. The figures go to the
progress line, to that step's `drafter.step` span and to OUTPUT_DIR/metrics.jsonl,
whose lines also carry `time_s` (seconds of training) and `tokens_per_s` per stage
since the previous logged step (`StageRates`), what report.html plots over time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from dflash import names
from dflash.files import write_text_atomic
from dflash.train.step import Figures, StepResult


def tau_estimate(accuracy_per_position: list[float]) -> float:
    """Expected accepted length + 1 if position k is accepted with its accuracy, given
    that every position before it was: 1 + Σ_k Π_{i≤k} acc_i."""
    tau, reach = 1.0, 1.0
    for accuracy in accuracy_per_position:
        reach *= accuracy
        tau += reach
    return tau


class StepMetrics:
    """Which steps are logged, their figures, and the metrics.jsonl writer."""

    def __init__(
        self,
        log_every: int,
        first_step: int,
        total_steps: int,
        path: Path | None,
        eval_every: int | None = None,
    ):
        self.log_every, self.first_step, self.total_steps = log_every, first_step, total_steps
        self.path, self.eval_every = path, eval_every

    def continue_file(self) -> None:
        """A resumed run's metrics.jsonl keeps the whole lines of the steps up to its
        first step: a line cut by a crash, or the lines of steps after the checkpoint it
        resumes from (an earlier one), would be glued to or repeat the new ones."""
        if self.path is None or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True):
            try:
                record = json.loads(line) if line.endswith("\n") else None
            except ValueError:
                record = None
            if isinstance(record, dict) and record.get("step", 0) <= self.first_step:
                kept.append(line)
        write_text_atomic(self.path, "".join(kept))

    def due(self, step: int) -> bool:
        """Whether `step` (1-based, global) is logged: every log_every, the first and last,
        and every --eval-every (its τ lands on the step's line)."""
        every = self.eval_every or 0
        evaluated = every > 0 and step % every == 0
        return (
            evaluated
            or step % self.log_every == 0
            or step in (self.first_step + 1, self.total_steps)
        )

    def read(self, step: int, result: StepResult) -> Figures:
        """The step's figures, with one device-to-host transfer."""
        m = result.metrics
        parts = [result.loss.reshape(1).float(), m["grad_norm"].reshape(1).float()]
        parts.append(m["tau_proxy"].reshape(1).float())
        nonfinite = m["nonfinite"].float()  # NonFiniteGuard.state
        accuracy = m["accuracy_per_position"].float()
        device = parts[0].device
        values = torch.cat([*parts, nonfinite.to(device), accuracy.to(device)]).tolist()
        per_position = values[6:]
        return {
            "step": step,
            "loss": values[0],
            "accuracy_per_position": per_position,
            # Both on random anchors of this step's training rows, against the data's next
            # tokens: tau_estimate multiplies the positions' accuracies as if they were
            # independent (an underestimate); tau_chain follows each block's own run of
            # correct predictions, as a verifier accepts them.
            "tau_estimate": tau_estimate(per_position),
            "tau_chain": values[2],
            "grad_norm": values[1],
            "lr": result.lr,
            "bad_steps": int(values[3]),  # non-finite steps skipped so far in the run
            "bad_steps_in_a_row": int(values[4]),
            "diverged_at_step": int(values[5]) or None,
        }

    def write(self, figures: Figures) -> None:
        """Appends one JSON line to metrics.jsonl (when the run has an output file)."""
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(figures) + "\n")


def amend_line(path: Path, step: int, figures: Figures) -> None:
    """Adds `figures` to metrics.jsonl's line of `step` when it is the last one (the final
    evaluation joins the last step's line), else appends a line of its own."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    try:
        last = json.loads(lines[-1]) if lines else None
    except ValueError:
        last = None
    if isinstance(last, dict) and last.get("step") == step:
        lines[-1] = json.dumps({**last, **figures})
    else:
        lines.append(json.dumps({"step": step, **figures}))
    write_text_atomic(path, "".join(line + "\n" for line in lines))


class StageRates:
    """Tokens/s of each stage between two calls, from cumulative counters.

    `read()` returns (seconds since training started, {stage: tokens so far})."""

    def __init__(self, read: Callable[[], tuple[float, Mapping[str, int]]]) -> None:
        self._read = read
        self._last: tuple[float, Mapping[str, int]] = (0.0, {})

    def figures(self) -> Figures:
        """{"time_s": ..., "tokens_per_s": {stage: rate since the previous call}}."""
        now_s, tokens = self._read()
        then_s, before = self._last
        self._last = (now_s, dict(tokens))
        span_s = now_s - then_s
        rates = {
            stage: (count - before.get(stage, 0)) / span_s if span_s > 0 else 0.0
            for stage, count in tokens.items()
        }
        return {"time_s": round(now_s, 3), "tokens_per_s": rates}


def span_attributes(figures: Figures) -> Figures:
    """The attributes a logged step's `drafter.step` span carries."""
    return {
        names.METRIC_LOSS: figures["loss"],
        names.METRIC_TAU_ESTIMATE: figures["tau_estimate"],
        names.METRIC_GRAD_NORM: figures["grad_norm"],
        names.METRIC_LR: figures["lr"],
        names.METRIC_ACCURACY: list(figures["accuracy_per_position"]),
    }
