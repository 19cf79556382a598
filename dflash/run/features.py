"""Where a run's target features come from, chosen once: the live target, a batch cache
written by `cache-hidden`, per-sample hidden-state files (speculators' layout), or a vLLM
engine streaming them through a bounded spool (`--target-engine vllm`, dflash.run.streamed).

`feature_source(cfg)` is the one place that looks at `--hidden-cache`; the run asks the
`FeatureSource` it returns where the target loads, which layers feed the drafter, the
rows (per-sample files are their own rows), the target stage's forward, the bytes it
reads, whether the final evaluation can run, and what to say at start. Speculators
hides its online and offline data behind one dataset hook; this is the same idea for a
run whose target may never run.

The sources themselves: dflash.run.target_features (the live target, and the contract),
dflash.run.cached_features (--hidden-cache), dflash.run.streamed_features (vLLM).
"""

from __future__ import annotations

from pathlib import Path

from dflash.config.settings import TrainConfig
from dflash.offline.sample_cache import cache_format
from dflash.run.cached_features import BatchCache, SampleFiles
from dflash.run.streamed_features import StreamedSamples
from dflash.run.target_features import FeatureSource


def feature_source(cfg: TrainConfig) -> FeatureSource:
    """The one place that decides where the run's features come from (a directory
    holding neither kind of cache, or both, is one line)."""
    if cfg.target.engine == "vllm":
        return StreamedSamples(cfg)
    if cfg.data.hidden_cache is None:
        return FeatureSource(cfg)
    directory = Path(cfg.data.hidden_cache)
    if cache_format(directory) == "speculators":
        return SampleFiles(cfg, directory)
    return BatchCache(cfg, directory)
