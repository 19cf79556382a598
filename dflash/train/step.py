"""One drafter training step: the unit that the reference loop and the pipeline run.

`DrafterTrainer.step` runs the five phases of docs/design.md §5 and returns device
tensors: nothing in it reads a value back to the host, so on a GPU the drafter's
stream never waits for the host inside a phase. `dflash.train.step_metrics` reads the figures
once every --log-every steps.

The step never holds [B, N, Bs, V] logits: the drafter returns its final-normed
states and `chunked_dflash_loss` applies the LM head per anchor chunk
(--loss-chunk-size); soft labels come from the target's final-norm states through
the same frozen head. --grad-accum splits the batch's rows into micro-batches whose
gradients sum exactly to those of the whole batch (`GradAccumulator`); a step whose
loss or gradient norm is not finite changes nothing (`NonFiniteGuard`).

Precision (--precision, resolved per device and width by
dflash.config.devices.resolve_precision; `auto` is bf16 on CUDA, and on a CPU with native
bf16 for a drafter of hidden size 512 or more): under bf16 the drafter's weights,
gradients and AdamW moments stay fp32 (master weights) and its forward runs under bf16
autocast; the frozen target, and with it the shared embedding and LM head, is bf16
(dflash.target.load.target_dtype, run_precision); fp32 matmuls may use TF32 on CUDA; the
loss chunks (logits, softmax, CE, KL) are fp32. Why: bf16 weights would drop every
update below 1/256 of a weight, which AdamW's updates at lr 6e-4 mostly are, while
autocast runs the matmuls at bf16 speed (on an AVX512-BF16 CPU about 3x fp32's); a bf16
softmax over a 152k vocabulary loses the tail that the KL and the CE gradient are made
of. Under fp32 everything is fp32, exactly as before the option.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from dflash import names
from dflash.config.devices import precision_text, resolve_precision
from dflash.config.settings import TrainConfig
from dflash.data.datasets import Batch
from dflash.nn.schedule import warmup_cosine
from dflash.objective.blocks import BlockInputs, prepare_blocks
from dflash.objective.loss import (
    ChunkedLossOutput,
    block_metrics,
    chunked_dflash_loss,
    gather_target_hidden,
)
from dflash.objective.noise import NoiseSchedule
from dflash.target.model import TargetOutput
from dflash.train.optim import GradAccumulator, NonFiniteGuard, grad_norm, nonfinite

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link
    from torch.optim.optimizer import StateDict

PhaseFn = Callable[[str], AbstractContextManager[object]]
# Any: a logged step's figures as StepMetrics.read gives them (floats, ints, None, a list
# of floats), to which the run adds its own (stage rates, evaluations) before one JSON line.
Figures = dict[str, Any]


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
    # chunked_loss.block_metrics, grad_norm, and "nonfinite": NonFiniteGuard.state
    metrics: dict[str, Tensor] = field(default_factory=dict)
    figures: Figures | None = None  # host values, on logged steps (step_metrics)
    context: Context | None = None  # on logged steps: its drafter.step span's OTel context
    # Where the caller records it (the pipeline's replica 0): an OTel Link to its
    # drafter.step span, for the checkpoint and eval spans that follow it.
    link: Link | None = None


def micro_batches(num_rows: int, grad_accum: int) -> list[slice]:
    """Rows of each micro-batch: `grad_accum` near-equal parts (fewer if rows are few)."""
    parts = max(1, min(grad_accum, num_rows))
    size = -(-num_rows // parts)
    return [slice(i, min(i + size, num_rows)) for i in range(0, num_rows, size)]


class DrafterTrainer:
    """Optimizer, schedule, non-finite guard and the five phases of one drafter step.

    With several replicas (threads or ranks), `grad_sync` combines the gradients once
    per optimizer step, after the last micro-batch: it takes this replica's sums (of
    w*l and of the loss's denominator, gradients undivided), adds every replica's up
    and divides once, so the step follows the loss of all the examples together, however
    they were split among replicas, ranks and micro-batches; it returns that loss.
    """

    def __init__(self, drafter: nn.Module, cfg: TrainConfig, device: torch.device | str) -> None:
        self.drafter, self.cfg, self.device = drafter, cfg, torch.device(device)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        opt = cfg.optim
        drafter.activation_checkpointing = opt.activation_checkpointing
        # fused: the one kernel that can skip a non-finite step without a host sync
        self.optimizer = torch.optim.AdamW(
            self.params, lr=opt.lr, betas=(0.9, 0.95), weight_decay=opt.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: warmup_cosine(s, opt.warmup_steps, cfg.run.steps, opt.min_lr_ratio),
        )
        self.noise = NoiseSchedule.parse(cfg.loss.noise_schedule, cfg.run.steps)
        self.accumulator = GradAccumulator(self.params)
        self.guard = NonFiniteGuard(opt.max_bad_steps, self.device)
        self.grad_sync: Callable[[Tensor, Tensor], Tensor] | None = None
        self.step_count = 0
        self.last_loss: Tensor | None = None
        # bf16 autocast where --precision resolves to bf16 here (module docstring).
        option, width = cfg.pipeline.precision, drafter.config.hidden_size
        self.precision = resolve_precision(option, self.device, width)
        self.precision_text = precision_text(option, self.device, width)  # start-up line
        self.autocast_dtype = torch.bfloat16 if self.precision == "bf16" else None
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for what stays fp32

    @property
    def block_size(self) -> int:
        """The drafter's own block size: at run time the one owner of that fact."""
        return self.drafter.config.block_size

    def _autocast(self) -> AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def block_inputs(self, host: Batch) -> BlockInputs:
        """Anchors, blocks, labels and context starts of a host batch, on the drafter
        device; the draws depend only on (seed, batch id, step)."""
        gen = torch.Generator(device="cpu").manual_seed(
            anchor_seed(self.cfg.run.seed, host.batch_id)
        )
        options = {
            "num_anchors": self.cfg.loss.num_anchors,
            "block_size": self.block_size,
            "mask_token_id": self.drafter.mask_id,
            "noise": self.noise,
            "step": self.step_count,
            "generator": gen,
        }
        blocks = prepare_blocks(host.input_ids, host.loss_mask, doc_ids=host.doc_ids, **options)
        return blocks.to(self.device)

    def step(
        self, batch: Batch, target_out: TargetOutput, phase: PhaseFn = null_phase
    ) -> StepResult:
        """One optimizer step on `batch` (any device) given the target's features."""
        self.drafter.train()
        with phase(names.ANCHOR_SELECTION):
            # Drawn on the host, then copied over: the device is never read back.
            blocks = self.block_inputs(batch.to("cpu"))
        return self._learn(batch.num_tokens, target_out, blocks, phase)

    def _learn(
        self, num_tokens: int, target_out: TargetOutput, blocks: BlockInputs, phase: PhaseFn
    ) -> StepResult:
        """Forward, loss and backward per micro-batch, then one (guarded) optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        parts = micro_batches(blocks.block_ids.shape[0], self.cfg.optim.grad_accum)
        micro = self._micro_step
        outs = [micro(target_out, blocks, rows, phase, rows is parts[-1]) for rows in parts]
        loss = self.last_loss
        assert loss is not None
        lr = self.scheduler.get_last_lr()[0]
        with phase(names.OPTIMIZER):
            norm = grad_norm(self.params, self.cfg.optim.grad_clip)
            self.guard.step(self.optimizer, nonfinite(loss, norm), self.step_count + 1)
            self.scheduler.step()
        self.step_count += 1
        combined = combined_metrics(outs, blocks.valid)
        metrics = {**combined, "grad_norm": norm.detach(), "nonfinite": self.guard.state.clone()}
        return StepResult(loss, num_tokens, lr, metrics)

    def _micro_step(
        self, target_out: TargetOutput, blocks: BlockInputs, rows: slice, phase: PhaseFn, last: bool
    ) -> ChunkedLossOutput:
        """Forward, loss and backward of some rows; the last one also finishes the
        gradients (sets last_loss) and lets the replicas average them."""
        part, loss_cfg = blocks.rows(rows), self.cfg.loss
        with phase(names.BLOCK_PREDICTION), self._autocast():
            states = self.drafter.hidden_states(
                target_out.hidden[rows], part.block_ids, part.anchors, part.keep, part.ctx_start
            )  # [b, N, Bs, D]
        with phase(names.LOSS):  # outside autocast: the loss chunks are fp32
            final, target_states = target_out.final_hidden, None  # final[B, T, D]
            if loss_cfg.use_soft_labels and final is not None:  # None: the loss says what lacks
                target_states = gather_target_hidden(final[rows], part.anchors, self.block_size)
            labels, in_vocab = self.drafter.draft_labels(part.labels)
            head = self.drafter.lm_head
            out = chunked_dflash_loss(
                states,
                head,
                labels,
                part.valid,
                loss_cfg,
                target_states,
                in_vocab=in_vocab,
                given=part.given,
            )
        with phase(names.BACKWARD):
            self.accumulator.backward(out.weighted_sum, out.denominator)
            if last and self.grad_sync is None:
                self.last_loss = self.accumulator.finish()  # of all rows
        if last and self.grad_sync is not None:
            with phase(names.GRAD_SYNC):  # every replica's sums together, before anyone steps
                self.last_loss = self.grad_sync(*self.accumulator.take())
        return out

    def check_figures(self, figures: Figures) -> None:
        """On a logged step: DivergedError once --max-bad-steps bad steps came in a row."""
        self.guard.check(figures.get("diverged_at_step"))

    def state_dict(self) -> StateDict:
        last = None if self.last_loss is None else float(self.last_loss)
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step_count": self.step_count,
            "last_loss": last,
            "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, state: StateDict) -> None:
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
        self.guard.load_state_dict(state.get("guard", {}))
        saved = state["last_loss"]
        self.last_loss = None if saved is None else torch.tensor(saved)


def combined_metrics(outs: list[ChunkedLossOutput], valid: Tensor) -> dict[str, Tensor]:
    """The step's metrics over all its micro-batches (valid[B, N, Bs] of the whole batch)."""
    if len(outs) == 1:
        return outs[0].metrics
    correct = torch.cat([o.correct for o in outs])  # [B, N, Bs]
    run = torch.cat([o.run for o in outs])  # [B, N]
    ce_sum = torch.stack([o.ce_sum for o in outs]).sum()
    weight_sum = torch.stack([o.weight_sum for o in outs]).sum()
    return block_metrics(correct, run, valid, ce_sum, weight_sum)
