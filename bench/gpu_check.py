"""GPU check: the paper recipe on a Qwen3-8B-shaped target, under each CUDA timing mode.

Builds a Qwen3-8B-shaped Hugging Face target with random weights in bf16 (nothing is
downloaded), a 5-layer drafter with fp32 master weights under bf16 autocast, and runs
the paper's step (block 16, 512 anchors, 3,072-token rows, AdamW 6e-4 with warmup,
γ 7, chunked loss, flex block-sparse attention) for --steps steps with
--cuda-timing off, sync and events. Prints tokens/s, peak memory, each timing mode's
cost against off, and whether the CUDA event times agree with the host times of the
synchronized run. The step is the trainer's own (`DrafterTrainer` on a config of
configs/paper.yaml's settings, the target stage's `capture_fn`), on random token rows.

    python bench/gpu_check.py               # one GPU, well under 10 minutes
    python bench/gpu_check.py --small       # reduced size on CPU (CI); a host clock
                                            # stands in for CUDA events: no GPU figures
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

import tracing
from dflash.config.settings import config_from_options
from dflash.data.datasets import Batch
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.run.estimate import estimate_for_config
from dflash.run.target_features import capture_fn
from dflash.target.geometry import TargetGeometry
from dflash.target.load import target_dtype
from dflash.target.synthetic import (
    QWEN3_8B,
    QWEN3_8B_MASK_TOKEN_ID,
    TINY_QWEN3,
    random_qwen3_target,
)
from dflash.train.step import DrafterTrainer

MODES = ("off", "sync", "events")
PHASES = ("target.forward", "drafter.block_prediction", "drafter.loss", "drafter.backward",
          "drafter.optimizer")  # fmt: skip


@dataclass(frozen=True)
class Recipe:
    shape: TargetGeometry
    mask_token_id: int
    seq_len: int
    num_anchors: int
    batch_size: int
    block_size: int = 16
    drafter_layers: int = 5
    lr: float = 6e-4
    warmup_steps: int = 4
    gamma: float = 7.0


PAPER = Recipe(QWEN3_8B, QWEN3_8B_MASK_TOKEN_ID, seq_len=3072, num_anchors=512, batch_size=2)
SMALL = Recipe(dataclasses.replace(TINY_QWEN3, vocab_size=4096, num_layers=6), 4095,
               seq_len=256, num_anchors=32, batch_size=1, drafter_layers=2)  # fmt: skip


class Step:
    """Target forward + one trainer step (its own phases), on random token rows."""

    def __init__(self, recipe: Recipe, device: torch.device) -> None:
        self.recipe, self.device = recipe, device
        self.target = random_qwen3_target(recipe.shape, device, target_dtype(device))
        self.cfg = config_from_options({
            "seq_len": recipe.seq_len, "batch_size": recipe.batch_size,
            "num_anchors": recipe.num_anchors, "block_size": recipe.block_size,
            "drafter_layers": recipe.drafter_layers, "lr": recipe.lr,
            "warmup_steps": recipe.warmup_steps, "loss_decay_gamma": recipe.gamma,
        })  # fmt: skip
        dcfg = DrafterConfig.for_target(
            self.target, num_layers=recipe.drafter_layers, block_size=recipe.block_size,
            mask_token_id=recipe.mask_token_id,
        )  # fmt: skip
        drafter = DFlashDrafter(dcfg, self.target.embed_tokens, self.target.lm_head).to(device)
        self.trainer = DrafterTrainer(drafter, self.cfg, device)  # fp32 master weights
        self.forward = capture_fn(self.target, dcfg.target_layer_ids, False, device)
        self.gen = torch.Generator().manual_seed(0)
        self.steps = 0

    def __call__(self) -> None:
        r, dev = self.recipe, self.device
        ids = torch.randint(0, r.mask_token_id, (r.batch_size, r.seq_len), generator=self.gen)
        batch = Batch(self.steps, ids, torch.ones_like(ids, dtype=torch.bool))
        with tracing.phase("target.forward", device=dev):
            target_out = self.forward(batch)
        self.trainer.step(batch, target_out, phase=lambda name: tracing.phase(name, device=dev))
        self.steps += 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS, KiB


@contextlib.contextmanager
def _telemetry(mode: str, device: torch.device) -> Iterator[tracing.Telemetry]:
    clock = None if device.type == "cuda" else tracing.HostClock()  # CPU: host stand-in
    telemetry = tracing.setup(tracing.TracingConfig(cuda_timing=mode), device_clock=clock)
    try:
        yield telemetry
    finally:
        telemetry.shutdown(timeout_s=10.0)


def run_mode(step: Step, mode: str, steps: int) -> dict[str, object]:
    dev = step.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with _telemetry(mode, dev) as telemetry:
        _sync(dev)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(dev)
        wall_s = time.perf_counter() - start
    snap = telemetry.stats.snapshot()
    host = {p: snap.phases[p].mean_s for p in PHASES if p in snap.phases}
    device = {p: snap.phases[p + tracing.DEVICE_SUFFIX].mean_s for p in PHASES
              if p + tracing.DEVICE_SUFFIX in snap.phases}  # fmt: skip
    tokens = steps * step.recipe.batch_size * step.recipe.seq_len
    return {"tok_s": tokens / wall_s, "wall_s": wall_s, "peak_gib": _peak_gib(dev),
            "host": host, "device": device}  # fmt: skip


def agreement(sync_host: dict[str, float], events_device: dict[str, float]) -> list[str]:
    """Per phase: events device mean vs synchronized host mean (10% or 0.5 ms)."""
    lines = []
    for name in PHASES:
        if name not in events_device or name not in sync_host:
            lines.append(f"  {name:<26} no device time recorded")
            continue
        a, b = sync_host[name], events_device[name]
        ok = abs(a - b) <= max(0.10 * max(a, b), 5e-4)
        lines.append(f"  {name:<26} sync host {a * 1e3:9.2f} ms  events device "
                     f"{b * 1e3:9.2f} ms  {'agree' if ok else 'DISAGREE'}")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="Reduced size on CPU (CI).")
    parser.add_argument("--steps", type=int, default=None, help="Timed steps per mode.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps before the modes.")
    parser.add_argument("--batch-size", type=int, default=None, help="Rows per step.")
    args = parser.parse_args()
    recipe = SMALL if args.small else PAPER
    if args.batch_size:
        recipe = Recipe(**{**recipe.__dict__, "batch_size": args.batch_size})
    steps = args.steps or (3 if args.small else 20)
    device = torch.device("cpu" if args.small else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; use --small for the CPU run")
    step = Step(recipe, device)  # the trainer allows TF32 on CUDA
    for _ in range(args.warmup):  # compiles flex attention, warms the allocator
        step()
    results = {mode: run_mode(step, mode, steps) for mode in MODES}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    r = recipe
    print(f"device {name}; target {r.shape.hidden_size}x{r.shape.num_layers} "
          f"V={r.shape.vocab_size}; {r.batch_size} rows x {r.seq_len} tokens, "
          f"{r.num_anchors} anchors, block {r.block_size}; {steps} steps per mode")  # fmt: skip
    print("\n".join(estimate_for_config(step.cfg, step.target.geometry, device)))
    off = results["off"]["tok_s"]
    for mode, res in results.items():
        cost = (off / res["tok_s"] - 1) * 100
        print(f"  cuda-timing {mode:<6} {res['tok_s']:10.0f} tok/s  peak {res['peak_gib']:6.1f} GiB"
              f"  cost vs off {cost:+6.1f}%")  # fmt: skip
    print("CUDA events vs host times of the synchronized run:")
    print("\n".join(agreement(results["sync"]["host"], results["events"]["device"])))
    if device.type != "cuda":
        print("CPU run: the event times come from a host-clock stand-in, not a GPU; "
              "no GPU figures were measured.")  # fmt: skip


if __name__ == "__main__":
    main()
