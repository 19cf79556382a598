import math

import pytest
import torch
import torch.nn.functional as F

from dflash.config.settings import LossConfig, default_gamma
from dflash.errors import DFlashError
from dflash.objective.blocks import block_labels, build_blocks, gather_target_logits, select_anchors
from dflash.objective.loss import streak_weights
from dflash.objective.noise import NoiseSchedule, ObjectiveError
from dflash.objective.reference import dflash_loss

MASK = 99


def test_anchors_are_valid_sorted_unique_and_padded() -> None:
    loss_mask = torch.zeros(3, 20, dtype=torch.bool)
    loss_mask[0, 2:9] = True  # valid anchors 2..7 (p and p+1 in the mask): 6 of them
    loss_mask[1, :] = True  # 19 valid anchors
    loss_mask[2, 5] = True  # a lone position: no valid anchor
    gen = torch.Generator().manual_seed(0)
    anchors, keep = select_anchors(loss_mask, 8, gen)
    assert anchors.shape == keep.shape == (3, 8)
    assert keep.sum(1).tolist() == [6, 8, 0]
    for row in range(3):
        kept = anchors[row][keep[row]].tolist()
        assert kept == sorted(set(kept))
        assert all(loss_mask[row, p] and loss_mask[row, p + 1] for p in kept)
        assert not keep[row, len(kept) :].any()  # padding comes last
    assert sorted(anchors[0][keep[0]].tolist()) == [2, 3, 4, 5, 6, 7]


def test_anchor_sampling_is_deterministic_and_roughly_uniform() -> None:
    loss_mask = torch.ones(1, 11, dtype=torch.bool)  # valid anchors 0..9
    a1, _ = select_anchors(loss_mask, 3, torch.Generator().manual_seed(5))
    a2, _ = select_anchors(loss_mask, 3, torch.Generator().manual_seed(5))
    assert torch.equal(a1, a2)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(11)
    for _ in range(2000):
        anchors, _ = select_anchors(loss_mask, 1, gen)
        counts[anchors[0, 0]] += 1
    assert counts[10] == 0
    assert counts[:10].min() > 150 and counts[:10].max() < 250  # expected 200 each


def test_num_anchors_below_one_is_an_error() -> None:
    with pytest.raises(ObjectiveError, match="--num-anchors 0"):
        select_anchors(torch.ones(1, 8, dtype=torch.bool), 0)


def test_blocks_hold_clean_anchor_then_masks() -> None:
    ids = torch.arange(10).unsqueeze(0) + 10  # tokens 10..19
    anchors = torch.tensor([[2, 8]])
    blocks = build_blocks(ids, anchors, 4, MASK)
    assert blocks.tolist() == [[[12, MASK, MASK, MASK], [18, MASK, MASK, MASK]]]


def test_noise_schedule_anneals_and_never_masks_past_end_clean() -> None:
    noise = NoiseSchedule(start_mask_ratio=0.0, end_mask_ratio=1.0, anneal_steps=10)
    assert noise.mask_ratio(0) == 0.0 and noise.mask_ratio(5) == 0.5 and noise.mask_ratio(20) == 1
    ids = torch.arange(10).unsqueeze(0) + 10
    blocks = build_blocks(ids, torch.tensor([[2, 8]]), 4, MASK, noise, step=0)
    # Ratio 0 keeps in-range tokens clean; positions 10 and 11 do not exist: masked.
    assert blocks.tolist() == [[[12, 13, 14, 15], [18, 19, MASK, MASK]]]
    with pytest.raises(ObjectiveError, match="1.5"):
        NoiseSchedule(start_mask_ratio=1.5)


def test_labels_are_unshifted_and_validity_is_hand_checked() -> None:
    ids = torch.arange(8).unsqueeze(0) + 10
    loss_mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    anchors, keep = torch.tensor([[1, 6, 0]]), torch.tensor([[True, True, False]])
    labels, valid = block_labels(ids, loss_mask, anchors, keep, 3)
    assert labels[0, 0].tolist() == [11, 12, 13]
    assert labels[0, 1, :2].tolist() == [16, 17]
    assert valid[0].tolist() == [
        [False, True, True],  # k=0 never counts
        [False, True, False],  # 6+2 = 8 is past the end
        [False, False, False],  # padding
    ]
    masked = torch.tensor([[[False, False, True], [False, True, True], [False, True, True]]])
    _, valid_masked = block_labels(ids, loss_mask, anchors, keep, 3, masked=masked)
    assert valid_masked[0, 0].tolist() == [False, False, True]


def test_loss_weights_match_a_hand_computation() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 2, 4, 7)
    labels = torch.randint(0, 7, (1, 2, 4))
    valid = torch.tensor([[[False, True, True, True], [False, True, False, True]]])
    out = dflash_loss(logits, labels, valid, LossConfig(gamma=2.0))
    num = den = 0.0
    for n in range(2):
        for k in range(1, 4):
            if valid[0, n, k]:
                w = math.exp(-(k - 1) / 2.0)
                ce = F.cross_entropy(logits[0, n, k][None], labels[0, n, k][None]).item()
                num, den = num + w * ce, den + w
    assert out.loss.item() == pytest.approx(num / den, rel=1e-5)


def test_default_gamma_by_block_size() -> None:
    assert [default_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert 5.0 < default_gamma(12) < 7.0
    assert default_gamma(32) > 7.0 and default_gamma(4) >= 1.0


def test_streak_weights_match_a_hand_computation() -> None:
    ce = torch.tensor([[[9.0, 0.1, 0.5, 2.0]]], requires_grad=True)
    valid = torch.tensor([[[False, True, True, True]]])
    alpha = 0.25
    q = [(1 - alpha) * math.exp(-c) + alpha for c in (0.1, 0.5, 2.0)]
    reach = [q[0], q[0] * q[1], q[0] * q[1] * q[2]]
    expected = [sum(reach), reach[1] + reach[2], reach[2]]
    w = streak_weights(ce, valid, alpha)
    assert w[0, 0, 1:].tolist() == pytest.approx(expected, rel=1e-6)
    assert not w.requires_grad
    # alpha = 1 ignores the CE: weight j counts the positions m >= j.
    ones = streak_weights(ce, valid, 1.0)
    assert ones[0, 0, 1:].tolist() == [3.0, 2.0, 1.0]


def test_soft_labels_kl_is_zero_when_drafter_matches_target() -> None:
    torch.manual_seed(1)
    target = torch.randn(1, 2, 4, 11)
    labels = target.argmax(-1)
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    kl_only = LossConfig(use_soft_labels=True, kl_weight=1.0, kl_temperature=2.0)
    assert dflash_loss(target.clone(), labels, valid, kl_only, target).loss.item() == pytest.approx(
        0.0, abs=1e-6
    )
    other = torch.randn(1, 2, 4, 11, requires_grad=True)
    out = dflash_loss(other, labels, valid, kl_only, target)
    assert out.loss.item() > 0.01
    out.loss.backward()
    assert other.grad is not None and other.grad.abs().sum() > 0
    ce_only = LossConfig(use_soft_labels=True, kl_weight=0.0)
    plain = dflash_loss(other, labels, valid, LossConfig())
    assert dflash_loss(other, labels, valid, ce_only, target).loss.item() == pytest.approx(
        plain.loss.item()
    )
    with pytest.raises(ObjectiveError, match="target logits"):
        dflash_loss(other, labels, valid, kl_only)


def test_target_logits_are_gathered_one_position_before_the_label() -> None:
    target = torch.arange(10, dtype=torch.float32)[None, :, None].expand(1, 10, 3)  # value = pos
    out = gather_target_logits(target, torch.tensor([[2, 8]]), 4)
    assert out[0, :, :, 0].tolist() == [[1, 2, 3, 4], [7, 8, 9, 9]]  # clamped at the end


def test_metrics_count_accuracy_and_accept_proxy() -> None:
    labels = torch.tensor([[[5, 1, 2, 3], [5, 1, 2, 3]]])
    logits = F.one_hot(labels, 8).float() * 10
    logits[0, 1, 2] = F.one_hot(torch.tensor(7), 8) * 10  # second block wrong at k=2
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    valid[..., 0] = False
    metrics = dflash_loss(logits, labels, valid, LossConfig()).metrics
    assert metrics["accuracy_per_position"][:2].tolist() == [1.0, 0.5]
    assert float(metrics["tau_proxy"]) == pytest.approx((4 + 2) / 2)  # streaks 3 and 1, +1 each


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"kl_temperature": 0.0}, "--kl-temperature"),
        ({"kl_weight": 1.5}, "--kl-weight"),
        ({"streak_alpha": -0.1}, "--streak-alpha"),
        ({"gamma": 0.0}, "--loss-decay-gamma"),
    ],
)
def test_bad_loss_settings_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(DFlashError, match=flag):  # the loss settings live in dflash.config
        LossConfig(**kwargs)


def test_streak_weights_stop_at_the_first_invalid_position() -> None:
    # B=8, only k=1..3 valid (the row ends), alpha 0.5, CE 0.5 everywhere.
    ce = torch.full((1, 1, 8), 0.5)
    valid = torch.tensor([[[False, True, True, True, False, False, False, False]]])
    w = streak_weights(ce, valid, 0.5)
    # q~ = 0.5 * exp(-0.5) + 0.5 = 0.80327; w1 = q~ + q~^2 + q~^3, w2 = q~^2 + q~^3, w3 = q~^3
    assert w[0, 0, 1:4].tolist() == pytest.approx([1.9668, 1.1635, 0.5183], abs=1e-4)
    assert w[0, 0, 4:].tolist() == [0.0] * 4
    # A hole in the loss mask ends the streak too: nothing after it counts.
    hole = torch.tensor([[[False, True, False, True, True, True, True, True]]])
    assert streak_weights(ce, hole, 0.5)[0, 0, 2:].tolist() == [0.0] * 6


def test_streak_weights_replace_the_decay_unless_gamma_is_set() -> None:
    assert LossConfig(streak_alpha=0.5).decay_gamma(8) is None
    assert LossConfig(streak_alpha=0.5, gamma=3.0).decay_gamma(8) == 3.0  # both explicit
    assert LossConfig().decay_gamma(8) == 4.0
    logits = torch.zeros(1, 1, 4, 5)  # uniform: CE = ln 5 everywhere
    labels = torch.zeros(1, 1, 4, dtype=torch.long)
    valid = torch.tensor([[[False, True, True, True]]])
    only_streak = dflash_loss(logits, labels, valid, LossConfig(streak_alpha=0.5))
    q = 0.5 * 0.2 + 0.5  # q~ with p = 1/5
    assert only_streak.metrics["weight_sum"] == pytest.approx(
        (q + q**2 + q**3) + (q**2 + q**3) + q**3, rel=1e-5
    )
    both = dflash_loss(logits, labels, valid, LossConfig(streak_alpha=0.5, gamma=1.0))
    decay = [1.0, math.exp(-1.0), math.exp(-2.0)]
    streak = [q + q**2 + q**3, q**2 + q**3, q**3]
    assert both.metrics["weight_sum"] == pytest.approx(
        sum(d * s for d, s in zip(decay, streak, strict=True)), rel=1e-5
    )


def _ce_for(q_tilde: list[float], alpha: float) -> torch.Tensor:
    """Per-position CE whose smoothed confidence (1-α)·exp(-CE) + α is `q_tilde`."""
    return torch.tensor([[[-math.log((q - alpha) / (1 - alpha)) for q in q_tilde]]])


def test_dpace_weights_go_on_through_a_visible_position() -> None:
    """The issue's case: B=8, a token left visible by the noise schedule at k=3. It is
    accepted for sure (q~ = 1) and no term of the suffix sums: the streak goes on.
    Before, it ended the streak: [0, 1.72, 0.77, 0, 0, 0, 0, 0]."""
    alpha = 0.5
    reach = [1.0, 0.95, 0.77, 0.77, 0.69, 0.61, 0.34, 0.33]  # prod_{i<=m} q~_i wanted
    q_tilde = [1.0] + [reach[k] / reach[k - 1] for k in range(1, 8)]
    q_tilde[3] = 0.75  # whatever the drafter's confidence there: the token is given
    ce = _ce_for(q_tilde, alpha)
    valid = torch.tensor([[[False, True, True, False, True, True, True, True]]])
    given = torch.tensor([[[True, False, False, True, False, False, False, False]]])
    weights = streak_weights(ce, valid, alpha, given) * valid
    expected = [0.0, 3.69, 2.74, 0.0, 1.97, 1.28, 0.67, 0.33]  # by hand: suffix sums
    assert weights[0, 0].tolist() == pytest.approx(expected, abs=1e-6)
    # Without `given` the position is a loss-mask hole: the streak ends there.
    ended = streak_weights(ce, valid, alpha) * valid
    assert ended[0, 0].tolist() == pytest.approx([0, 1.72, 0.77, 0, 0, 0, 0, 0], abs=1e-6)


def test_dpace_divides_by_the_scored_blocks_not_the_weights() -> None:
    """D-PACE keeps its weights' mass (the expected accepted length) in the loss: the
    weighted sum is divided by the number of blocks with a scored position (2 of 3
    here), as its authors do; --streak-alpha (the same weights) divides by their sum."""
    logits = torch.zeros(1, 3, 4, 5)  # uniform: CE = ln 5 everywhere
    labels = torch.zeros(1, 3, 4, dtype=torch.long)
    valid = torch.tensor([[[False, True, True, True]] * 2 + [[False] * 4]])
    q = 0.5 * 0.2 + 0.5  # q~ with p = 1/5, α = 0.5
    weight_sum = 2 * ((q + q**2 + q**3) + (q**2 + q**3) + q**3)
    dpace = dflash_loss(logits, labels, valid, LossConfig(position_weighting="dpace"))
    assert dpace.loss.item() == pytest.approx(weight_sum * math.log(5) / 2, rel=1e-5)
    streak = dflash_loss(logits, labels, valid, LossConfig(streak_alpha=0.5))
    assert streak.loss.item() == pytest.approx(math.log(5), rel=1e-5)
    decay = dflash_loss(logits, labels, valid, LossConfig())
    assert decay.loss.item() == pytest.approx(math.log(5), rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "line"),
    [
        ({"dpace_alpha": 0.0}, "--dpace-alpha"),
        ({"dpace_alpha": 1.5}, "--dpace-alpha"),
        ({"position_weighting": "dpace", "streak_alpha": 0.5}, "--streak-alpha 0.5 is invalid"),
        ({"dpace_alpha": 0.4}, "--dpace-alpha 0.4 needs --position-weighting dpace"),
    ],
)
def test_bad_dpace_settings_name_the_value(kwargs: dict, line: str) -> None:
    with pytest.raises(DFlashError, match=line):
        LossConfig(**kwargs)


def test_dpace_alpha_defaults_to_the_papers() -> None:
    assert LossConfig(position_weighting="dpace").confidence_alpha == 0.5
    assert LossConfig(position_weighting="dpace", dpace_alpha=0.3).confidence_alpha == 0.3
    assert LossConfig(position_weighting="dpace").decay_gamma(16) is None
    assert LossConfig().confidence_alpha is None


def test_noise_schedule_specs() -> None:
    assert NoiseSchedule.parse("all", 100) == NoiseSchedule()
    lin = NoiseSchedule.parse("linear:0.5:1", 100)
    assert (lin.mask_ratio(0), lin.mask_ratio(50), lin.mask_ratio(100)) == (0.5, 0.75, 1.0)
    bad_specs = {
        "linear:0.5": "expected 'all'",
        "cosine:0:1": "expected 'all'",
        "linear:a:1": "numbers",
        "linear:0.5:1.5": "1.5 is outside",
    }
    for bad, why in bad_specs.items():
        with pytest.raises(ObjectiveError, match=why):
            NoiseSchedule.parse(bad, 10)


def test_partially_masked_blocks_score_only_their_masked_positions() -> None:
    from dflash.objective.blocks import block_inputs

    ids = torch.arange(10, 22)[None]  # [1, 12]: token = 10 + position
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors, keep = torch.tensor([[1, 9]]), torch.tensor([[True, True]])
    noise = NoiseSchedule(start_mask_ratio=0.5, end_mask_ratio=0.5)
    gen = torch.Generator().manual_seed(0)
    blocks, labels, valid = block_inputs(ids, loss_mask, anchors, keep, 4, 99, noise, 0, gen)
    masked = blocks == 99
    assert masked[..., 1:].any() and (~masked[..., 1:]).any()  # a real mix at ratio 0.5
    # Visible tokens are the clean ones and never score; masked in-bounds positions do.
    assert torch.equal(blocks[~masked], labels[~masked])
    in_bounds = anchors[:, :, None] + torch.arange(4) < 12
    expected = masked & in_bounds
    expected[..., 0] = False
    assert torch.equal(valid, expected)
    # Block 1 (anchor 9) runs past the end: positions 12+ are masked and never valid.
    assert masked[0, 1, 3] and not valid[0, 1, 3]
    # The default schedule masks everything: labels as before, valid = block_labels'.
    full_blocks, _, full_valid = block_inputs(ids, loss_mask, anchors, keep, 4, 99)
    assert (full_blocks[..., 1:] == 99).all()
    assert torch.equal(full_valid, block_labels(ids, loss_mask, anchors, keep, 4)[1])
