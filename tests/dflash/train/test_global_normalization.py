"""One normalization for the whole step: the same examples give the same gradient on 1
rank or 2 (gloo), in 1 micro-batch or 2, in 1 replica or 2, with uneven valid-anchor
counts, under the decay's weighted mean and under D-PACE's per-block normalization.

Run as a script under torchrun, this file is also the worker of the two-rank test:
`torchrun --nproc-per-node 2 tests/dflash/train/test_global_normalization.py OUT_DIR`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dflash.config.settings import LossConfig
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.objective.blocks import block_labels, build_blocks, select_anchors
from dflash.objective.loss import chunked_dflash_loss
from dflash.pipeline.distributed import GradAverager
from dflash.target.load import wrap_tiny
from dflash.target.tiny import TinyLM, TinyLMConfig
from dflash.train.optim import GradAccumulator
from tests.dflash.app_fixtures import script_env, torchrun_command

BS, T, ROWS = 4, 24, 4
CONFIGS = {"decay": LossConfig(), "dpace": LossConfig(position_weighting="dpace")}
# Rows 0-2 learn almost everywhere, row 3 at a few positions: a split by rows leaves
# the replicas (ranks) with very different valid-anchor counts.
SPLIT = (slice(0, 3), slice(3, 4))
REL_TOL = 1e-5  # fp32 rounding


def _model_and_batch() -> tuple[DFlashDrafter, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    target = wrap_tiny(TinyLM(TinyLMConfig(hidden_size=32, num_layers=4, num_heads=2)))
    drafter_cfg = DrafterConfig.for_target(target, num_layers=1, block_size=BS)
    torch.manual_seed(1)
    drafter = DFlashDrafter(drafter_cfg, target.embed_tokens, target.lm_head)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (ROWS, T), generator=gen)
    loss_mask = torch.rand(ROWS, T, generator=gen) > 0.1
    loss_mask[3] = False
    loss_mask[3, 5:8] = True  # 2 valid anchor positions in the last row
    anchors, keep = select_anchors(loss_mask, 8, gen)
    blocks = build_blocks(ids, anchors, BS, drafter.mask_id)
    labels, valid = block_labels(ids, loss_mask, anchors, keep, BS)
    hidden = target.capture(ids, drafter.config.target_layer_ids, with_logits=False).hidden
    return drafter, (hidden, blocks, anchors, keep, labels, valid)


def _backward(drafter: DFlashDrafter, batch, rows: slice, cfg: LossConfig, acc: GradAccumulator):
    hidden, blocks, anchors, keep, labels, valid = (x[rows] for x in batch)
    states = drafter.hidden_states(hidden, blocks, anchors, keep)
    out = chunked_dflash_loss(states, drafter.lm_head, labels, valid, cfg, chunk_size=5)
    acc.backward(out.weighted_sum, out.denominator)


def _flat_grad(drafter: DFlashDrafter) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in drafter.parameters() if p.grad is not None])


def _whole_batch(cfg: LossConfig) -> tuple[torch.Tensor, float]:
    drafter, batch = _model_and_batch()
    acc = GradAccumulator(drafter.parameters())
    _backward(drafter, batch, slice(0, ROWS), cfg, acc)
    loss = acc.finish()
    return _flat_grad(drafter), float(loss)


def _assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    rel = float((got - ref).norm() / ref.norm())
    assert rel <= REL_TOL, f"relative difference {rel:.3g}"


def test_uneven_counts_make_local_means_differ() -> None:
    """The split is one where a mean of the replicas' own means would be wrong: their
    denominators differ by far more than rounding."""
    drafter, batch = _model_and_batch()
    valid = batch[-1]
    counts = [int(valid[rows].sum()) for rows in SPLIT]
    assert counts[0] > 10 * counts[1] > 0


@pytest.mark.parametrize("name", CONFIGS)
def test_two_micro_batches_give_the_whole_batch_gradient(name: str) -> None:
    cfg = CONFIGS[name]
    ref, ref_loss = _whole_batch(cfg)
    drafter, batch = _model_and_batch()
    acc = GradAccumulator(drafter.parameters())
    for rows in SPLIT:
        _backward(drafter, batch, rows, cfg, acc)
    loss = acc.finish()
    _assert_same(_flat_grad(drafter), ref)
    assert float(loss) == pytest.approx(ref_loss, rel=REL_TOL)


@pytest.mark.parametrize("name", CONFIGS)
def test_two_replicas_give_the_whole_batch_gradient(name: str) -> None:
    cfg = CONFIGS[name]
    ref, ref_loss = _whole_batch(cfg)
    pairs = [_model_and_batch() for _ in SPLIT]
    averager = GradAverager([d for d, _ in pairs], threading.Event())
    losses: list[float] = [0.0, 0.0]

    def replica(i: int) -> None:
        drafter, batch = pairs[i]
        acc = GradAccumulator(drafter.parameters())
        _backward(drafter, batch, SPLIT[i], cfg, acc)
        losses[i] = float(averager.sync(i, *acc.take()))

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for drafter, _ in pairs:
        _assert_same(_flat_grad(drafter), ref)
    assert losses == pytest.approx([ref_loss, ref_loss], rel=REL_TOL)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_two_gloo_ranks_give_the_whole_batch_gradient(tmp_path: Path) -> None:
    cmd = [*torchrun_command(2), __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, cfg in CONFIGS.items():
        ref, ref_loss = _whole_batch(cfg)
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}-rank{rank}.pt")
            _assert_same(got["grad"], ref)
            assert got["loss"] == pytest.approx(ref_loss, rel=REL_TOL)


def _torchrun_worker(out_dir: Path) -> None:
    from dflash.pipeline.distributed import (
        destroy_distributed,
        dist_info_from_env,
        init_distributed,
    )

    info = dist_info_from_env()
    init_distributed(info, torch.device("cpu"))
    for name, cfg in CONFIGS.items():
        drafter, batch = _model_and_batch()
        averager = GradAverager([drafter], threading.Event())
        acc = GradAccumulator(drafter.parameters())
        _backward(drafter, batch, SPLIT[info.rank], cfg, acc)
        loss = float(averager.sync(0, *acc.take()))
        result = {"grad": _flat_grad(drafter), "loss": loss}
        torch.save(result, out_dir / f"{name}-rank{info.rank}.pt")
    destroy_distributed()


if __name__ == "__main__":
    _torchrun_worker(Path(sys.argv[1]))
