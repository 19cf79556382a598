"""Shared helpers of the app tests: a small untrained target and a seconds-long config."""

import pytest
import torch

from dflash.config import config_from_options
from dflash.devices import decide_placement
from dflash.run import Run, build_run
from dflash.step import DrafterTrainer
from dflash.tiny import TinyLM, TinyLMConfig

SMALL_LM = TinyLMConfig(hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64)


@pytest.fixture
def tiny_target(monkeypatch):
    """load_target returns an untrained small tiny LM: no minutes-long preparation."""
    from dflash import target as target_mod

    def load(spec, device="cpu", dtype=None, log=print):
        if not spec.startswith("builtin:"):
            return real_load(spec, device, dtype, log)
        torch.manual_seed(123)
        return target_mod.wrap_tiny(TinyLM(SMALL_LM), spec=spec).to(device=device, dtype=dtype)

    real_load = target_mod.load_target
    monkeypatch.setattr(target_mod, "load_target", load)


def write_corpus(directory):
    path = directory / "corpus.txt"
    if not path.exists():
        path.write_text("def f(x):\n    return x + 1\n" * 200)
    return path


def small_options(tmp_path, output_dir=None):
    return {
        "steps": 6, "batch_size": 2, "seq_len": 32, "drafter_layers": 1, "block_size": 4,
        "num_anchors": 4, "warmup_steps": 2, "eval_prompts": 0,
        "output_dir": str(output_dir or tmp_path), "data": str(write_corpus(tmp_path)),
    }  # fmt: skip


def cpu_run(cfg) -> Run:
    """build_run on the devices the config places on this (CPU) machine, quietly."""
    return build_run(cfg, decide_placement(cfg.pipeline), log=lambda _: None)


def small_cfg(tmp_path, output_dir=None, **overrides):
    """A seconds-long config; the corpus lives in tmp_path, outputs in output_dir."""
    return config_from_options({**small_options(tmp_path, output_dir), **overrides})


def record_losses(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """(batch id, loss) of every DrafterTrainer.step, in call order."""
    seen: list[tuple[int, float]] = []
    real_step = DrafterTrainer.step

    def step(self, batch, target_out, phase=None, **kw):
        result = real_step(self, batch, target_out, **({"phase": phase} if phase else {}))
        seen.append((batch.batch_id, float(result.loss)))
        return result

    monkeypatch.setattr(DrafterTrainer, "step", step)
    return seen
