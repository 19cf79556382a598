"""Shared helpers of the app tests: a small untrained target, a seconds-long config, and
test files run as torchrun workers."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from dflash.config.devices import decide_placement
from dflash.config.settings import config_from_options
from dflash.run.build import Run, build_run
from dflash.target import load as target_load
from dflash.target.tiny import TinyLM, TinyLMConfig
from dflash.train.step import DrafterTrainer

SMALL_LM = TinyLMConfig(hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64)


ROOT = Path(__file__).resolve().parents[2]


def _small_target_loader(real_load):
    """A load_target whose builtin targets are an untrained small tiny LM."""

    def load(spec, device="cpu", dtype=None, log=print, head_only=False):
        if not spec.startswith("builtin:"):
            return real_load(spec, device, dtype, log, head_only=head_only)
        torch.manual_seed(123)
        return target_load.wrap_tiny(TinyLM(SMALL_LM), spec=spec).to(device=device, dtype=dtype)

    return load


@pytest.fixture
def tiny_target(monkeypatch):
    """load_target returns an untrained small tiny LM: no minutes-long preparation."""
    monkeypatch.setattr(target_load, "load_target", _small_target_loader(target_load.load_target))


def small_target_everywhere() -> None:
    """What the tiny_target fixture does, for a test file run as a script."""
    target_load.load_target = _small_target_loader(target_load.load_target)


def torchrun_command(nproc: int) -> list[str]:
    """torchrun on this host with a rendezvous port the OS picks when it binds (choosing a
    free port first and passing it on races other processes that bind ports meanwhile)."""
    return ["torchrun", "--standalone", "--nproc-per-node", str(nproc)]


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a test file run as a script (a torchrun worker): the checkout
    first on the path, as pytest has it, so `tests.dflash...` imports resolve."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def run_torchrun_script(script: str, *args: str, nproc: int = 2) -> None:
    """Run the test file `script` as `nproc` torchrun workers with `args`; the workers'
    output is the failure's message."""
    command = [*torchrun_command(nproc), script, *args]
    proc = subprocess.run(
        command, env=script_env(), capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def write_corpus(directory):
    path = directory / "corpus.txt"
    if not path.exists():
        path.write_text("def f(x):\n    return x + 1\n" * 200)
    return path


def small_options(tmp_path, output_dir=None):
    sizes = {"steps": 6, "batch_size": 2, "seq_len": 32, "drafter_layers": 1, "block_size": 4}
    cheap = {"num_anchors": 4, "warmup_steps": 2, "eval_prompts": 0}
    paths = {"output_dir": str(output_dir or tmp_path), "data": str(write_corpus(tmp_path))}
    return {**sizes, **cheap, **paths}


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


# A value of every option that is not its default (config round trips, the CLI's flags).
NON_DEFAULT = {
    "data": "corpus.txt", "seq_len": 64, "batch_size": 3, "heldout_fraction": 0.1,
    "packing": "concat", "max_dropped_share": 0.25, "keep_cut_replies": True,
    "chat_rendering": "per-turn",
    "drafter_intermediate_size": 96,
    "mask_token_id": 7, "draft_vocab_size": 64,
    "chat_template_kwargs": "{\"enable_thinking\": false}",
    "noise_schedule": "linear:0.5:1", "init_from": "runs/old/drafter",
    "hidden_cache": "cache/", "strict_cache": True,
    "target": "builtin:other", "target_layers": (1, 3), "drafter_layers": 2,
    "block_size": 6, "num_anchors": 5, "loss_decay_gamma": 2.5, "use_soft_labels": True,
    "kl_temperature": 2.0, "kl_weight": 0.25, "position_weighting": "dpace", "dpace_alpha": 0.3,
    "loss_chunk_size": 4, "lr": 1e-3,
    "warmup_steps": 3, "grad_clip": 0.5, "weight_decay": 0.01, "min_lr_ratio": 0.2,
    "grad_accum": 2, "activation_checkpointing": True, "max_bad_steps": 3,
    "steps": 7, "seed": 11, "output_dir": "runs/x", "resume": "latest", "overwrite": True,
    "allow_data_change": True,
    "save_every": 2, "save_dtype": "bfloat16",
    "keep_checkpoints": 4, "log_every": 3, "eval_prompts": 2, "eval_new_tokens": 9,
    "eval_every": 3, "keep_best": True,
    "eval_prompt_tokens": 10, "debug": True, "allow_over_memory": True, "dry_run": True,
    "eval_engine": "vllm", "vllm_command": "python -m vllm.entrypoints.openai.api_server",
    "target_devices": ("cpu", "cpu"),
    "drafter_devices": ("cpu",), "batch_queue_size": 5, "hs_queue_size": 3,
    "precision": "fp32",
    "otlp_endpoint": "http://localhost:4317", "otlp_protocol": "http", "trace_level": "step",
    "trace_sample_ratio": 0.5, "trace_file": "spans.jsonl", "cuda_timing": "events",
    "profile_interval": 5.0, "service_name": "svc", "timeline": "tl.json", "nvtx": True,
    "torch_profile": "2:4", "report_to": ("tensorboard",), "eval_dtype": "bfloat16",
    "shard_drafter": True,
}  # fmt: skip
# Valid alone, not beside the rest of NON_DEFAULT (--streak-alpha refuses D-PACE,
# --drafter-init target --init-from, --target-engine vllm --packing concat).
NON_DEFAULT_ALONE = {
    "streak_alpha": 0.5, "drafter_init": "target", "target_engine": "vllm",
    "vllm_python": "/usr/bin/python3", "engine_args": "--tensor-parallel-size 2",
    "spool_dir": "spool/", "spool_size": "1GiB",
}  # fmt: skip
# What an option tested alone needs beside it (--dpace-alpha needs D-PACE).
COMPANIONS = {"dpace_alpha": {"position_weighting": "dpace"}}
