"""Pieces of one optimizer step: gradient accumulation and the non-finite guard.

Accumulation is exact: the loss of a step is sum(w * l) / sum(w) over all its
micro-batches, so each micro-batch backpropagates its unnormalized sum(w * l) and the
summed gradients are divided once by the total weight (a device tensor, known only
after the last micro-batch when streak weights depend on the drafter's own CE).

A step whose loss or gradient norm is not finite is skipped: no optimizer update,
counted, and after `max_bad_steps` in a row the run stops. Deciding to skip reads one
boolean on the host per optimizer step; everything else stays on the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from dflash.errors import DFlashError


class StepError(DFlashError):
    """A step setting out of range; the message names the flag."""


class DivergedError(RuntimeError):
    """Too many non-finite steps in a row: the run stops (its last good checkpoint stays)."""


class GradAccumulator:
    """Sums micro-batch gradients of sum(w * l); `finish` divides them by sum(w).

    Usage per optimizer step: `backward(out.weighted_sum, out.weight_sum)` for each
    micro-batch (an object with those two tensors, e.g. a ChunkedLossOutput), then
    `loss = finish()`. Nothing here reads a value on the host.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._weighted: Tensor | None = None
        self._weight: Tensor | None = None
        self.micro_batches = 0

    def backward(self, weighted_sum: Tensor, weight_sum: Tensor) -> None:
        weighted_sum.backward()
        w, ws = weight_sum.detach(), weighted_sum.detach()
        self._weight = w if self._weight is None else self._weight + w
        self._weighted = ws if self._weighted is None else self._weighted + ws
        self.micro_batches += 1

    def finish(self) -> Tensor:
        """Scale the gradients by 1 / total weight; -> the step's loss (device scalar)."""
        if self._weight is None or self._weighted is None:
            raise RuntimeError("GradAccumulator.finish() before any micro-batch")
        total = self._weight.clamp(min=1e-8)
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, total)  # no host sync: divides by a device scalar
        loss = self._weighted / total
        self._weighted = self._weight = None
        self.micro_batches = 0
        return loss


def grad_norm(params: Iterable[nn.Parameter], max_norm: float = 0.0) -> Tensor:
    """Global L2 norm of the gradients (device scalar); clipped to max_norm when > 0."""
    params = list(params)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


def nonfinite(loss: Tensor, norm: Tensor) -> Tensor:
    """BoolTensor[] on the device: True when the loss or the gradient norm is inf/NaN."""
    return ~(torch.isfinite(loss) & torch.isfinite(norm))


class NonFiniteGuard:
    """Skips and counts non-finite steps; raises DivergedError after max_bad_steps in a row."""

    def __init__(self, max_bad_steps: int = 10) -> None:
        if max_bad_steps < 1:
            raise StepError(f"--max-bad-steps {max_bad_steps} must be >= 1")
        self.max_bad_steps = max_bad_steps
        self.bad_steps = 0  # whole run
        self.bad_in_a_row = 0

    def step(self, optimizer: torch.optim.Optimizer, bad: Tensor, step: int) -> bool:
        """optimizer.step() unless `bad` (from `nonfinite`); -> whether it stepped.

        The one host read of the step: `bad` decides host-side control flow.
        """
        if not bool(bad):
            optimizer.step()
            self.bad_in_a_row = 0
            return True
        optimizer.zero_grad(set_to_none=True)
        self.bad_steps += 1
        self.bad_in_a_row += 1
        if self.bad_in_a_row >= self.max_bad_steps:
            raise DivergedError(
                f"step {step}: loss or gradient norm not finite for {self.bad_in_a_row} steps "
                f"in a row (--max-bad-steps {self.max_bad_steps}); stopping, the last good "
                "checkpoint is kept"
            )
        return False

    def state_dict(self) -> dict[str, int]:
        return {"bad_steps": self.bad_steps, "bad_in_a_row": self.bad_in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.bad_steps, self.bad_in_a_row = int(state["bad_steps"]), int(state["bad_in_a_row"])
