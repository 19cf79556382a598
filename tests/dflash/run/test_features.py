"""A run's feature source comes in two types: the plan, decided from the config before the
target loads, and the source its `open` gives, ready for the target stage's forwards."""

from __future__ import annotations

import pytest
import torch

from dflash.config.devices import decide_placement
from dflash.run.features import feature_plan
from dflash.run.offline import write_run_cache
from dflash.target import load as target_load
from tests.dflash.app_fixtures import small_cfg, tiny_target  # noqa: F401 - fixture

CPU = torch.device("cpu")


@pytest.mark.usefixtures("tiny_target")
def test_per_sample_files_open_with_their_rows_and_layers(tmp_path) -> None:
    """Opened, a source of per-sample files has read its rows and knows its layers: its
    forwards give each batch's states with no other call first."""
    cache = tmp_path / "cache"
    write_run_cache(small_cfg(tmp_path, packing="docs"), cache, fmt="speculators", log=print)
    cfg = small_cfg(tmp_path, tmp_path / "run", packing="docs", hidden_cache=str(cache))
    plan = feature_plan(cfg)
    placement = decide_placement(cfg.pipeline)
    assert plan.has_rows and not plan.runs_target and plan.load_device(placement) == CPU
    target = target_load.load_target(cfg.target.spec, CPU, torch.float32, log=print)
    source = plan.open(target, print)
    assert source.rows is not None and len(source.rows.train) > 0
    batches = (0, None)
    (device, forward), *more = source.forwards(
        target, source.layer_ids, source.rows.train, placement, batches
    )
    assert device == CPU and not more
    batch = source.rows.train.batch(0)
    out = forward(batch)
    width = len(source.layer_ids) * target.hidden_size
    assert out.hidden.shape == (*batch.input_ids.shape, width)


def test_the_live_target_loads_where_it_computes(tmp_path) -> None:
    plan = feature_plan(small_cfg(tmp_path))
    placement = decide_placement(small_cfg(tmp_path).pipeline)
    assert plan.runs_target and not plan.has_rows and not plan.head_only
    assert plan.load_device(placement) == placement.target
