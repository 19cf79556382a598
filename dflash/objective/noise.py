"""Which non-anchor block positions the drafter sees masked: the noise schedule.

The grammar of `--noise-schedule` is the config's (dflash.config.checks.noise_ratios);
this module turns it into the per-step masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.config.checks import noise_ratios
from dflash.errors import DFlashError


class ObjectiveError(DFlashError):
    """An objective setting out of range; the message names the flag."""


@dataclass(frozen=True)
class NoiseSchedule:
    """Which non-anchor block positions are masked.

    The mask ratio goes linearly from `start_mask_ratio` to `end_mask_ratio` over
    `anneal_steps` optimizer steps; the default (1.0 throughout) masks every
    non-anchor position, the paper's choice.
    """

    start_mask_ratio: float = 1.0
    end_mask_ratio: float = 1.0
    anneal_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("start_mask_ratio", "end_mask_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ObjectiveError(f"noise {name} {value} is outside [0, 1]")
        if self.anneal_steps < 0:
            raise ObjectiveError(f"noise anneal_steps {self.anneal_steps} is negative")

    @classmethod
    def parse(cls, spec: str, total_steps: int) -> NoiseSchedule:
        """`all` (every non-anchor position masked) or `linear:START:END`: the masked share
        goes from START to END over `total_steps` optimizer steps."""
        try:
            start, end = noise_ratios(spec)
        except ValueError as err:
            raise ObjectiveError(f"--noise-schedule {spec!r}: {err}") from None
        if spec == "all":
            return cls()
        return cls(start_mask_ratio=start, end_mask_ratio=end, anneal_steps=max(0, total_steps))

    def describe(self) -> str:
        if self.start_mask_ratio == self.end_mask_ratio == 1.0:
            return "all non-anchor masked"
        return (
            f"masked share {self.start_mask_ratio:g} -> {self.end_mask_ratio:g} "
            f"over {self.anneal_steps} steps"
        )

    def mask_ratio(self, step: int) -> float:
        if self.anneal_steps == 0 or step >= self.anneal_steps:
            return self.end_mask_ratio
        frac = step / self.anneal_steps
        return self.start_mask_ratio + frac * (self.end_mask_ratio - self.start_mask_ratio)

    def sample(
        self,
        shape: tuple[int, ...],  # (B, N, Bs)
        step: int,
        generator: torch.Generator | None,
        device: torch.device,
    ) -> Tensor:
        """BoolTensor[B, N, Bs]: True = masked. Position 0 (the anchor) is never masked."""
        ratio = self.mask_ratio(step)
        if ratio >= 1.0:
            masked = torch.ones(shape, dtype=torch.bool)  # draws nothing: default is RNG-free
        else:
            masked = torch.rand(shape, generator=generator) < ratio
        masked[..., 0] = False
        return masked.to(device)
