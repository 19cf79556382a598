"""Where a run's target features come from, chosen once: the live target, a batch cache
written by `cache-hidden`, per-sample hidden-state files (speculators' layout), or a vLLM
engine streaming them through a bounded spool (`--target-engine vllm`, dflash.run.streamed).

`feature_plan(cfg)` is the one place that looks at `--hidden-cache`; before the target
loads, the `FeaturePlan` it returns says where and how the target loads and whether the
rows are the source's own. Its `open`, once the target has loaded, gives the opened
`FeatureSource`: the layers that feed the drafter, its rows (per-sample files are their
own), the target stage's forwards, the bytes it reads, whether the final evaluation can
run, and what to say at start. Speculators hides its online and offline data behind one
dataset hook; this is the same idea for a run whose target may never run.

The sources themselves: dflash.run.target_features (the live target, and the contract),
dflash.run.cached_features (--hidden-cache), dflash.run.streamed_features (vLLM).
"""

from __future__ import annotations

from pathlib import Path

from dflash.config.settings import TrainConfig
from dflash.run.cached_features import cache_plan
from dflash.run.streamed_features import streamed_plan
from dflash.run.target_features import FeaturePlan, live_target


def feature_plan(cfg: TrainConfig) -> FeaturePlan:
    """The one place that decides where the run's features come from (a directory
    holding neither kind of cache, or both, is one line)."""
    if cfg.target.engine == "vllm":
        return streamed_plan(cfg)
    if cfg.data.hidden_cache is None:
        return live_target(cfg)
    return cache_plan(cfg, Path(cfg.data.hidden_cache))
