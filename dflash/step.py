"""One drafter training step: the unit that the reference loop and the pipeline run.

`DrafterTrainer.step` runs the five phases of DESIGN.md §5 and returns device
tensors: nothing in it reads a value back to the host, so on a GPU the drafter's
stream never waits for the host inside a phase. `dflash.metrics` reads the figures
once every --log-every steps.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dflash import names
from dflash.blocks import BlockInputs, prepare_blocks
from dflash.config import TrainConfig
from dflash.data import Batch
from dflash.objective import NoiseSchedule, dflash_loss, gather_target_logits
from dflash.schedule import warmup_cosine

PhaseFn = Callable[[str], AbstractContextManager[Any]]


def null_phase(name: str) -> AbstractContextManager[None]:
    """A phase that records nothing (the default when no tracing is set up)."""
    return nullcontext()


def anchor_seed(seed: int, batch_id: int) -> int:
    """Seed of a batch's anchor/noise RNG: a function of (seed, batch id) only, so
    results do not depend on which thread or replica runs the batch."""
    return int(np.random.SeedSequence([seed, batch_id]).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class StepResult:
    """What one step produced; the tensors live on the drafter device."""

    loss: Tensor  # 0-d, detached
    num_tokens: int
    lr: float  # the rate this step used (host-side schedule, no sync)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # see objective._metrics
    figures: dict[str, Any] | None = None  # host values, on logged steps (dflash.metrics)


class DrafterTrainer:
    """Optimizer, schedule and the five phases of one drafter step."""

    def __init__(self, drafter: nn.Module, cfg: TrainConfig, device: torch.device | str) -> None:
        self.drafter, self.cfg, self.device = drafter, cfg, torch.device(device)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        opt = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=opt.lr, betas=(0.9, 0.95), weight_decay=opt.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: warmup_cosine(s, opt.warmup_steps, cfg.run.steps, opt.min_lr_ratio),
        )
        self.noise = NoiseSchedule.parse(cfg.loss.noise_schedule, cfg.run.steps)
        self.grad_sync: Callable[[], None] | None = None
        self.step_count = 0
        self.last_loss: Tensor | None = None
        # bf16 autocast on GPU; CPU stays fp32 (CPU bf16 matmuls are slow and lossy).
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def block_inputs(self, host: Batch) -> BlockInputs:
        """Anchors, blocks, labels and context starts of a host batch, on the drafter
        device; the draws depend only on (seed, batch id, step)."""
        gen = torch.Generator(device="cpu").manual_seed(
            anchor_seed(self.cfg.run.seed, host.batch_id)
        )
        blocks = prepare_blocks(
            host.input_ids, host.loss_mask, doc_ids=host.doc_ids,
            num_anchors=self.cfg.loss.num_anchors, block_size=self.cfg.drafter.block_size,
            mask_token_id=self.drafter.mask_id, noise=self.noise, step=self.step_count,
            generator=gen,
        )  # fmt: skip
        return blocks.to(self.device)

    def step(self, batch: Batch, target_out: Any, phase: PhaseFn = null_phase) -> StepResult:
        """One optimizer step on `batch` (any device) given the target's features."""
        drafter, bs, loss_cfg = self.drafter, self.cfg.drafter.block_size, self.cfg.loss
        drafter.train()
        with phase(names.ANCHOR_SELECTION):
            # Drawn on the host, then copied over: the device is never read back.
            blocks = self.block_inputs(batch.to("cpu"))
        anchors = blocks.anchors
        with phase(names.BLOCK_PREDICTION), self._autocast():
            logits = drafter(
                target_out.hidden, blocks.block_ids, anchors, blocks.keep, blocks.ctx_start
            )  # [B, N, Bs, V]
        labels, valid = blocks.labels, blocks.valid
        with phase(names.LOSS):
            target_logits = None
            if loss_cfg.use_soft_labels:
                target_logits = gather_target_logits(target_out.logits, anchors, bs)
            out = dflash_loss(logits.float(), labels, valid, loss_cfg, target_logits)
        with phase(names.BACKWARD):
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            if self.grad_sync is not None:
                self.grad_sync()  # replicas average gradients before anyone steps
        lr = self.scheduler.get_last_lr()[0]
        with phase(names.OPTIMIZER):
            if self.cfg.optim.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
            else:
                grad_norm = torch.zeros((), device=self.device)
            self.optimizer.step()
            self.scheduler.step()
        self.step_count += 1
        self.last_loss = out.loss.detach()
        metrics = {**out.metrics, "grad_norm": grad_norm.detach()}
        return StepResult(self.last_loss, batch.num_tokens, lr, metrics)

    def state_dict(self) -> dict[str, Any]:
        last = None if self.last_loss is None else float(self.last_loss)
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step_count": self.step_count,
            "last_loss": last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The restored lr came from the saved run's schedule; a resume with another
        # --steps follows the new cosine from here on.
        last = self.scheduler.last_epoch
        for group, base_lr, fn in zip(
            self.optimizer.param_groups,
            self.scheduler.base_lrs,
            self.scheduler.lr_lambdas,
            strict=True,
        ):
            group["lr"] = base_lr * fn(last)
        self.step_count = int(state["step_count"])
        saved = state["last_loss"]
        self.last_loss = None if saved is None else torch.tensor(saved)
