"""Gradient averaging across replicas and ranks; the data sharding rule.

Run as a script under torchrun, this file is also the worker of the gloo test:
`torchrun --nproc-per-node 2 tests/dflash/pipeline/test_distributed.py OUT_DIR`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.pipeline.distributed import (
    DistInfo,
    DistributedError,
    GradAverager,
    batch_index,
    dist_info_from_env,
    rank_batch_indices,
    sync_initial_weights,
)
from tests.dflash.app_fixtures import script_env, torchrun_command


def test_dist_info_from_torchrun_env() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    info = dist_info_from_env(env)
    assert info == DistInfo(rank=3, world_size=4, local_rank=1, local_world_size=2)
    assert info.enabled and not info.is_main
    assert dist_info_from_env({}) == DistInfo()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside WORLD_SIZE=2"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ],
)
def test_bad_torchrun_env(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistributedError, match=message):
        dist_info_from_env(env)


def test_rank_r_reads_r_then_r_plus_world_size() -> None:
    world, replicas = 2, 2
    for rank in range(world):
        assert list(rank_batch_indices(3, rank, world, replicas)) == list(range(rank, 12, world))
    # Every batch of a step goes to exactly one (rank, replica), whatever the world size.
    for world in (1, 2, 3, 5):
        got = sorted(i for r in range(world) for i in rank_batch_indices(2, r, world, 2, 7))
        assert got == list(range(7, 7 + 2 * world * 2))


def test_single_rank_single_replica_is_the_reference_order() -> None:
    assert list(rank_batch_indices(4, 0, 1, 1, start_index=10)) == [10, 11, 12, 13]
    # Every (step, slot) in order, as batch_index numbers them:
    for world, replicas, start in ((1, 1, 0), (2, 3, 5), (4, 2, 9)):
        for rank in range(world):
            slots = [(s, k) for s in range(5) for k in range(replicas)]
            expected = [batch_index(s, k, rank, world, replicas, start) for s, k in slots]
            assert list(rank_batch_indices(5, rank, world, replicas, start)) == expected
    # Any number of steps is free until the batches are drawn (it was a list).
    huge = rank_batch_indices(10**22, 1, 2, 2)
    assert (huge[0], huge[1], bool(huge), huge[-1]) == (1, 3, True, 4 * 10**22 - 1)
    assert batch_index(3, 1, 1, 3, 2, start_index=5) == 5 + 3 * 6 + 1 + 3


def _replicas(n: int) -> list[nn.Module]:
    models = []
    for seed in range(n):
        torch.manual_seed(seed)  # deliberately different: sync_initial_weights must fix it
        models.append(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    return models


def _train_replica(model: nn.Module, sync, seed: int, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        sync(loss.detach(), torch.tensor(1.0))  # one unit of denominator each: the mean
        opt.step()


def test_replicas_in_threads_keep_identical_weights() -> None:
    models = _replicas(3)
    sync_initial_weights(models)
    stop = threading.Event()
    averager = GradAverager(models, stop)
    assert averager.needed
    threads = [
        threading.Thread(target=_train_replica, args=(m, averager.hook(i), 100 + i, 20))
        for i, m in enumerate(models)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    for other in models[1:]:
        for a, b in zip(models[0].parameters(), other.parameters(), strict=True):
            assert torch.equal(a, b)
    # Different data per replica, yet training moved the weights (not a no-op).
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    assert not torch.equal(fresh[0].weight, models[0][0].weight)


def test_averaged_gradient_is_the_mean() -> None:
    models = _replicas(2)
    sync_initial_weights(models)
    averager = GradAverager(models, threading.Event())
    for i, model in enumerate(models):
        for p in model.parameters():
            p.grad = torch.full_like(p, float(i + 1))
    losses: list[torch.Tensor] = []

    def sync(i: int) -> None:
        losses.append(averager.sync(i, torch.tensor(3.0 * (i + 1)), torch.tensor(1.0)))

    threads = [threading.Thread(target=sync, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for model in models:
        for p in model.parameters():
            assert torch.all(p.grad == 1.5)
    assert [float(loss) for loss in losses] == [4.5, 4.5]  # (3 + 6) / (1 + 1)


def test_replicas_weigh_by_their_denominators_not_equally() -> None:
    """Sums of w*l over replicas divided by the sum of their denominators: 10 scored
    positions on one replica and 1 on the other weigh 10:1, not 1:1."""
    models = _replicas(2)
    sync_initial_weights(models)
    averager = GradAverager(models, threading.Event())
    for i, model in enumerate(models):
        for p in model.parameters():
            p.grad = torch.full_like(p, (10.0, 1.0)[i])  # gradients of sum(w*l), undivided
    threads = [
        threading.Thread(target=averager.sync, args=(i, torch.tensor(0.0), torch.tensor(d)))
        for i, d in enumerate((10.0, 1.0))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for model in models:
        for p in model.parameters():
            torch.testing.assert_close(p.grad, torch.full_like(p, 11.0 / 11.0))


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def _torchrun_worker(out_dir: Path) -> None:
    from dflash.pipeline.distributed import destroy_distributed, init_distributed

    info = dist_info_from_env()
    init_distributed(info, torch.device("cpu"))
    models = _replicas(2 + info.rank)[-2:]  # ranks start from different weights
    sync_initial_weights(models)
    averager = GradAverager(models, threading.Event())
    threads = [
        threading.Thread(target=_train_replica, args=(m, averager.hook(i), 10 * info.rank + i, 10))
        for i, m in enumerate(models)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    if any(t.is_alive() for t in threads):
        # Tearing the group down under a thread still inside a collective aborts the
        # process (std::terminate); fail with a message instead.
        print("replica threads did not finish", file=sys.stderr, flush=True)
        os._exit(3)
    digests = {weights_digest(m) for m in models}
    assert len(digests) == 1, "replicas of one rank diverged"
    (out_dir / f"rank{info.rank}.sha256").write_text(digests.pop())
    destroy_distributed()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_two_ranks_gloo_keep_identical_weights(tmp_path: Path) -> None:
    cmd = [*torchrun_command(2), __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = [(tmp_path / f"rank{r}.sha256").read_text() for r in range(2)]
    assert digests[0] == digests[1]


if __name__ == "__main__":
    _torchrun_worker(Path(sys.argv[1]))
