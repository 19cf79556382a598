import pytest
import torch
from torch import nn

from dflash.config.settings import LossConfig
from dflash.objective.blocks import gather_target_logits
from dflash.objective.loss import chunked_dflash_loss, gather_target_hidden
from dflash.objective.noise import ObjectiveError
from dflash.objective.reference import dflash_loss
from dflash.target.load import wrap_tiny
from dflash.target.tiny import TinyLM, TinyLMConfig

B, N, BS, D, V, T = 2, 7, 6, 16, 200, 40


def make_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(D, V, bias=False).requires_grad_(False)
    nn.init.normal_(head.weight, std=0.3, generator=gen)
    hidden = torch.randn(B, N, BS, D, generator=gen)
    final = torch.randn(B, T, D, generator=gen)  # target final-norm states
    anchors = torch.sort(torch.randint(0, T, (B, N), generator=gen), dim=1).values
    anchors[0, -1] = T - 2  # a block running past the end
    labels = torch.randint(0, V, (B, N, BS), generator=gen)
    valid = torch.rand(B, N, BS, generator=gen) > 0.3
    valid[..., 0] = False
    valid[1, -2:] = False  # padded blocks
    return head, hidden, final, anchors, labels, valid


CONFIGS = [
    LossConfig(),
    LossConfig(gamma=3.0, streak_alpha=0.3),
    LossConfig(use_soft_labels=True, kl_temperature=1.7, kl_weight=0.6),
    LossConfig(use_soft_labels=True, kl_weight=1.0, streak_alpha=0.0),
]


def _dense(head, hidden, final, anchors, labels, valid, cfg):
    target_logits = None
    if cfg.use_soft_labels:
        target_logits = gather_target_logits(head(final), anchors, BS)
    return dflash_loss(head(hidden), labels, valid, cfg, target_logits)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_loss_gradients_and_metrics_equal_the_dense_loss(cfg: LossConfig, chunk_size) -> None:
    head, hidden, final, anchors, labels, valid = make_case()
    h_dense = hidden.clone().requires_grad_(True)
    ref = _dense(head, h_dense, final, anchors, labels, valid, cfg)
    ref.loss.backward()
    h_chunk = hidden.clone().requires_grad_(True)
    target_hidden = gather_target_hidden(final, anchors, BS) if cfg.use_soft_labels else None
    out = chunked_dflash_loss(h_chunk, head, labels, valid, cfg, target_hidden, chunk_size)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_chunk.grad, h_dense.grad, atol=1e-5, rtol=1e-5)
    assert h_dense.grad.abs().sum() > 0
    assert set(out.metrics) == set(ref.metrics)
    for name, value in out.metrics.items():
        assert isinstance(value, torch.Tensor)  # device tensors: no host sync
        torch.testing.assert_close(value, ref.metrics[name], atol=1e-5, rtol=1e-5, msg=name)


def test_weighted_sum_over_weight_sum_is_the_loss() -> None:
    head, hidden, _, _, labels, valid = make_case(1)
    out = chunked_dflash_loss(hidden, head, labels, valid, LossConfig(streak_alpha=0.5), None, 3)
    torch.testing.assert_close(out.loss, out.weighted_sum / out.weight_sum)
    assert not out.weight_sum.requires_grad


def test_no_logits_sized_tensor_is_kept_for_the_backward() -> None:
    head, hidden, final, anchors, labels, valid = make_case(2)
    cfg = LossConfig(use_soft_labels=True, streak_alpha=0.2)
    logits_bytes = B * N * BS * V * 4
    saved = {"dense": 0, "chunked": 0}

    def counting(key):
        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[key] += t.numel() * t.element_size()
            return t

        return pack

    h = hidden.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(counting("dense"), lambda t: t):
        _dense(head, h, final, anchors, labels, valid, cfg)
    target_hidden = gather_target_hidden(final, anchors, BS)
    with torch.autograd.graph.saved_tensors_hooks(counting("chunked"), lambda t: t):
        chunked_dflash_loss(h, head, labels, valid, cfg, target_hidden, chunk_size=2)
    states_bytes = B * N * BS * D * 4  # the chunk inputs (drafter and target states)
    assert saved["dense"] > 2 * logits_bytes
    assert saved["chunked"] <= 2 * states_bytes + 1024  # no [.., V] tensor at all


def test_soft_labels_from_the_targets_final_norm_equal_those_from_its_logits() -> None:
    torch.manual_seed(0)
    target = wrap_tiny(TinyLM(TinyLMConfig(hidden_size=32, num_layers=4, num_heads=2)))
    ids = torch.randint(0, 256, (B, T))
    with_logits = target.capture(ids, [1, 2], with_logits=True)
    with_final = target.capture(ids, [1, 2], with_logits=False, with_final_hidden=True)
    assert with_final.logits is None and with_final.final_hidden.shape == (B, T, 32)
    torch.testing.assert_close(with_final.hidden, with_logits.hidden)
    head = target.lm_head
    torch.testing.assert_close(head(with_final.final_hidden), with_logits.logits)
    anchors = torch.sort(torch.randint(0, T, (B, N)), dim=1).values
    labels = torch.randint(0, 256, (B, N, BS))
    valid = torch.ones(B, N, BS, dtype=torch.bool)
    valid[..., 0] = False
    hidden = torch.randn(B, N, BS, 32)
    cfg = LossConfig(use_soft_labels=True, kl_weight=1.0)  # the KL alone
    target_logits = gather_target_logits(with_logits.logits, anchors, BS)
    ref = dflash_loss(head(hidden), labels, valid, cfg, target_logits)
    target_hidden = gather_target_hidden(with_final.final_hidden, anchors, BS)
    out = chunked_dflash_loss(hidden, head, labels, valid, cfg, target_hidden, 5)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)


def test_bad_chunk_size_and_missing_target_states_are_errors() -> None:
    head, hidden, _, _, labels, valid = make_case()
    with pytest.raises(ObjectiveError, match="--loss-chunk-size 0"):
        chunked_dflash_loss(hidden, head, labels, valid, LossConfig(), chunk_size=0)
    with pytest.raises(ObjectiveError, match="final-norm"):
        chunked_dflash_loss(hidden, head, labels, valid, LossConfig(use_soft_labels=True))
