"""Pieces of one optimizer step: gradient accumulation and the non-finite guard.

Accumulation is exact: the loss of a step is sum(w * l) / sum(w) over all its
micro-batches, so each micro-batch backpropagates its unnormalized sum(w * l) and the
summed gradients are divided once by the total weight (a device tensor, known only
after the last micro-batch when streak weights depend on the drafter's own CE).

A step whose loss or gradient norm is not finite is skipped: no optimizer update,
counted, and after `max_bad_steps` in a row the run stops. Nothing reads the device:
the skip is the fused optimizers' `found_inf` protocol (the one torch's GradScaler
uses: a float tensor set as `optimizer.found_inf`, nonzero = the fused kernel leaves
parameters, moments and step count untouched), and the counters are device tensors
read with the step's figures on logged steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dflash.errors import DFlashError


class StepError(DFlashError):
    """A step setting out of range; the message names the flag."""


class DivergedError(RuntimeError):
    """Too many non-finite steps in a row: the run stops without saving anything more."""


class GradAccumulator:
    """Sums micro-batch gradients of sum(w * l) and the loss's denominators; `finish`
    divides the gradients by the total denominator (sum(w), or the scored blocks under
    D-PACE): the step's gradient is that of the whole batch's loss, however it was cut.

    Usage per optimizer step: `backward(out.weighted_sum, out.denominator)` for each
    micro-batch (e.g. of a ChunkedLossOutput), then `loss = finish()`; or, where
    replicas divide by their common denominator, `take()` and hand the sums on.
    Nothing here reads a value on the host.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._weighted: Tensor | None = None
        self._denominator: Tensor | None = None
        self.micro_batches = 0

    def backward(self, weighted_sum: Tensor, denominator: Tensor) -> None:
        weighted_sum.backward()
        d, ws = denominator.detach(), weighted_sum.detach()
        self._denominator = d if self._denominator is None else self._denominator + d
        self._weighted = ws if self._weighted is None else self._weighted + ws
        self.micro_batches += 1

    def take(self) -> tuple[Tensor, Tensor]:
        """(sum of w*l, sum of denominators) of this step's micro-batches, gradients left
        undivided; the accumulator starts over."""
        if self._denominator is None or self._weighted is None:
            raise RuntimeError("GradAccumulator.take() before any micro-batch")
        totals = (self._weighted, self._denominator)
        self._weighted = self._denominator = None
        self.micro_batches = 0
        return totals

    def finish(self) -> Tensor:
        """Scale the gradients by 1 / total denominator; -> the step's loss (device scalar)."""
        weighted, denominator = self.take()
        return divide_gradients(self.params, weighted, denominator)


def divide_gradients(
    params: Iterable[nn.Parameter], weighted: Tensor, denominator: Tensor
) -> Tensor:
    """Divides the parameters' gradients of sum(w*l) by `denominator`; -> the loss
    weighted / denominator (device scalars: no host sync)."""
    total = denominator.clamp(min=1e-8)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, total)
    return weighted / total


def grad_norm(params: Iterable[nn.Parameter], max_norm: float = 0.0) -> Tensor:
    """Global L2 norm of the gradients (device scalar); clipped to max_norm when > 0."""
    params = list(params)
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    # A sharded drafter's norm is a replicated DTensor (the shards' norms combined):
    # its local value is the whole norm, and the guard mixes it with plain tensors.
    return norm.to_local() if isinstance(norm, DTensor) else norm


def nonfinite(loss: Tensor, norm: Tensor) -> Tensor:
    """BoolTensor[] on the device: True when the loss or the gradient norm is inf/NaN."""
    return ~(torch.isfinite(loss) & torch.isfinite(norm))


class NonFiniteGuard:
    """Skips and counts non-finite steps on the device; `check` stops a diverged run.

    State: int64[3] on the device = (bad steps in the run, bad steps in a row, the
    1-based step at which the streak reached max_bad_steps, 0 while it has not).
    """

    def __init__(self, max_bad_steps: int = 10, device: torch.device | str = "cpu") -> None:
        if max_bad_steps < 1:
            raise StepError(f"--max-bad-steps {max_bad_steps} must be >= 1")
        self.max_bad_steps = max_bad_steps
        self.state = torch.zeros(3, dtype=torch.int64, device=device)

    def step(self, optimizer: torch.optim.Optimizer, bad: Tensor, step: int) -> None:
        """optimizer.step(), a no-op on the device where `bad` (from `nonfinite`) holds.

        `step` is the 1-based number of this step (named when the run diverges).
        """
        if not optimizer.defaults.get("fused"):
            raise TypeError("NonFiniteGuard needs a fused optimizer (fused=True)")
        # (mypy ignore below) fused optimizers read found_inf (torch's GradScaler protocol)
        optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            # (mypy ignore below) fused optimizers read found_inf (torch's GradScaler protocol)
            del optimizer.found_inf  # type: ignore[attr-defined]
        b = bad.to(torch.int64)
        total, row, at = self.state.unbind()
        row = (row + 1) * b  # a good step ends the streak
        hit = (row >= self.max_bad_steps) & (at == 0)
        self.state.copy_(torch.stack([total + b, row, torch.where(hit, step, at)]))

    def check(self, diverged_at_step: float | None) -> None:
        """DivergedError when the state's third value, as read on the host, is a step."""
        if diverged_at_step:
            at = int(diverged_at_step)
            raise DivergedError(
                f"step {at}: loss or gradient norm not finite for {self.max_bad_steps} steps "
                f"in a row (--max-bad-steps {self.max_bad_steps}); stopped without saving, so the "
                "newest checkpoint is the last good one"
            )

    def raise_if_diverged(self) -> None:
        """`check` on the device state: one read, for checkpoints (not every step)."""
        self.check(self.state.tolist()[2])

    @property
    def bad_steps(self) -> int:
        """Non-finite steps of the run so far (reads the device)."""
        return int(self.state[0])

    def state_dict(self) -> dict[str, int]:
        total, row, at = self.state.tolist()
        return {"bad_steps": total, "bad_in_a_row": row, "diverged_at": at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        values = [state.get(k, 0) for k in ("bad_steps", "bad_in_a_row", "diverged_at")]
        self.state.copy_(torch.tensor(values, dtype=torch.int64))
