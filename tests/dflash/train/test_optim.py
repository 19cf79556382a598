import math

import pytest
import torch

from dflash.config.settings import LossConfig
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.objective.blocks import block_labels, build_blocks, select_anchors
from dflash.objective.loss import chunked_dflash_loss
from dflash.target.load import wrap_tiny
from dflash.target.model import TargetModel
from dflash.target.tiny import TinyLM, TinyLMConfig
from dflash.train.optim import (
    DivergedError,
    GradAccumulator,
    NonFiniteGuard,
    StepError,
    grad_norm,
    nonfinite,
)

BS, T, ROWS = 4, 24, 4
CFG = LossConfig(streak_alpha=0.4)  # weights depend on the drafter's own CE


@pytest.fixture(scope="module")
def target() -> TargetModel:
    torch.manual_seed(0)
    return wrap_tiny(TinyLM(TinyLMConfig(hidden_size=32, num_layers=4, num_heads=2)))


def make_drafter(target: TargetModel) -> DFlashDrafter:
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=BS)
    torch.manual_seed(1)
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head)


def make_batch(target: TargetModel, drafter: DFlashDrafter, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (ROWS, T), generator=gen)
    loss_mask = torch.rand(ROWS, T, generator=gen) > 0.2
    anchors, keep = select_anchors(loss_mask, 6, gen)
    blocks = build_blocks(ids, anchors, BS, drafter.mask_id)
    labels, valid = block_labels(ids, loss_mask, anchors, keep, BS)
    hidden = target.capture(ids, drafter.config.target_layer_ids, with_logits=False).hidden
    return hidden, blocks, anchors, keep, labels, valid


def _loss(drafter: DFlashDrafter, batch, rows: slice, cfg: LossConfig = CFG):
    hidden, blocks, anchors, keep, labels, valid = (x[rows] for x in batch)
    states = drafter.hidden_states(hidden, blocks, anchors, keep)
    return chunked_dflash_loss(states, drafter.lm_head, labels, valid, cfg, chunk_size=5)


def _grads(drafter: DFlashDrafter) -> list[torch.Tensor]:
    return [p.grad.clone() for p in drafter.parameters()]


@pytest.mark.parametrize("cfg", [CFG, LossConfig(position_weighting="dpace"), LossConfig()])
def test_accumulated_micro_batches_equal_one_big_batch(
    target: TargetModel, cfg: LossConfig
) -> None:
    """Whatever the loss's denominator (the weights' sum; the scored blocks under D-PACE)."""
    big, small = make_drafter(target), make_drafter(target)
    batch = make_batch(target, big)
    full = _loss(big, batch, slice(0, ROWS), cfg)
    full.loss.backward()
    acc = GradAccumulator(small.parameters())
    for rows in (slice(0, 1), slice(1, 4)):  # unequal micro-batches: weights differ
        out = _loss(small, batch, rows, cfg)
        acc.backward(out.weighted_sum, out.denominator)
    loss = acc.finish()
    torch.testing.assert_close(loss, full.loss.detach(), atol=1e-5, rtol=1e-5)
    for got, ref in zip(_grads(small), _grads(big), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for model in (big, small):
        torch.optim.AdamW(model.parameters(), lr=6e-4).step()  # the paper lr
    for got, ref in zip(small.parameters(), big.parameters(), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_changes_nothing_but_memory(target: TargetModel) -> None:
    plain, ckpt = make_drafter(target), make_drafter(target)
    ckpt.activation_checkpointing = True
    batch = make_batch(target, plain, seed=3)
    ref, out = _loss(plain, batch, slice(0, ROWS)), _loss(ckpt, batch, slice(0, ROWS))
    ref.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss)
    for got, want in zip(_grads(ckpt), _grads(plain), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_drafter_logits_are_the_head_of_its_hidden_states_on_every_backend(target) -> None:
    drafter = make_drafter(target)
    hidden, blocks, anchors, keep, _, _ = make_batch(target, drafter, seed=4)
    with torch.no_grad():
        drafter.attention_backend = "dense"
        logits = drafter(hidden, blocks, anchors, keep)
        drafter.attention_backend = "grouped"
        states = drafter.hidden_states(hidden, blocks, anchors, keep)
        torch.testing.assert_close(drafter.lm_head(states), logits, atol=1e-5, rtol=1e-5)


def test_guard_skips_non_finite_steps_counts_them_and_stops_after_the_limit() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    guard = NonFiniteGuard(max_bad_steps=2)
    for step, loss_value in enumerate([1.0, math.nan, 2.0, math.inf], start=1):
        param.grad = torch.full((3,), loss_value)
        bad = nonfinite(torch.tensor(loss_value), grad_norm([param]))
        before = param.detach().clone()
        moments = {k: v.clone() for k, v in opt.state[param].items()}
        guard.step(opt, bad, step)
        changed = not torch.equal(param.detach(), before)
        assert changed == math.isfinite(loss_value), step
        if not math.isfinite(loss_value):  # moments and step count untouched too
            for key, value in moments.items():
                assert torch.equal(opt.state[param][key], value), (step, key)
        assert torch.isfinite(param).all()
    assert guard.state_dict() == {"bad_steps": 2, "bad_in_a_row": 1, "diverged_at": 0}
    guard.raise_if_diverged()  # one in a row: not yet
    param.grad = torch.ones(3)
    guard.step(opt, nonfinite(torch.tensor(1.0), torch.tensor(math.nan)), 5)
    with pytest.raises(DivergedError, match="step 5: .* 2 steps in a row"):
        guard.raise_if_diverged()
    param.grad = torch.ones(3)
    guard.step(opt, nonfinite(torch.tensor(1.0), torch.tensor(1.0)), 6)  # a good step after
    assert guard.state_dict() == {"bad_steps": 3, "bad_in_a_row": 0, "diverged_at": 5}
    restored = NonFiniteGuard(max_bad_steps=2)
    restored.load_state_dict(guard.state_dict())
    assert torch.equal(restored.state, guard.state)
    with pytest.raises(StepError, match="--max-bad-steps 0"):
        NonFiniteGuard(0)
    with pytest.raises(TypeError, match="fused"):
        guard.step(torch.optim.SGD([param], lr=0.1), torch.tensor(False), 7)


def test_grad_norm_clips_like_torch() -> None:
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.full((4,), 3.0), torch.full((2,), 4.0)
    norm = grad_norm([a, b])
    assert float(norm) == pytest.approx(math.sqrt(4 * 9 + 2 * 16))
    grad_norm([a, b], max_norm=1.0)
    assert float(grad_norm([a, b])) == pytest.approx(1.0, rel=1e-5)
