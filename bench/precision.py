"""fp32 against bf16 on the CPU, side by side in one process: the SmolLM2-135M recipe's
drafter step (docs/training.md) in tokens/s, the loss curves of a short run of each,
and the target's forward.

Usage: python bench/precision.py [--steps 100] [--batches 25] [--warmup 3]
                                 [--target-reps 2] [--widths 128,256,576]

The recipe's step: seq-len 512, batch 2, block 8, 2 drafter layers, 48 anchors, draft
vocabulary 8,192 of SmolLM2's 49,152, target layers 1,7,14,20,27, lr 2e-3. The target is
a Qwen3-shaped model with SmolLM2-135M's geometry and random weights (hidden 576, 30
layers, 9 heads, 3 KV heads, intermediate 1,536): nothing is downloaded. Its features
for --batches rows of the Python standard library's source (byte tokens) are computed
once and given to both drafters, as a hidden cache would (the recipe trains from one).
Both drafters start from the same weights and take the same batches, one step each in
turn, so machine noise hits both alike; the first --warmup steps are not timed.

Printed (JSON lines): tokens/s of the drafter step under each precision and their ratio;
the mean loss of the last 10 steps of each and their difference (the stated tolerance:
within 2% of fp32's); the target's forward tokens/s with fp32 and bf16 weights (online
training, cache-hidden); with --widths, the step's bf16/fp32 ratio at narrower hidden
sizes (what AUTO_BF16_MIN_HIDDEN rests on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sysconfig
import time
from pathlib import Path

import torch

from dflash.config.devices import cpu_bf16_flags
from dflash.config.settings import TrainConfig, config_from_options
from dflash.data.datasets import Batch
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.drafter.vocab import select_draft_vocab
from dflash.nn.rope import RopeSpec
from dflash.observe.flops import cpu_matmul_peak_gflops
from dflash.target.geometry import TargetGeometry
from dflash.target.load import run_precision
from dflash.target.model import TargetModel, TargetOutput
from dflash.target.synthetic import random_qwen3_target
from dflash.train.step import DrafterTrainer

SMOLLM2_135M = TargetGeometry(
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49_152,
    rope=RopeSpec(100_000.0),
    max_position_embeddings=8192,
)
RECIPE = {
    "seq_len": 512, "batch_size": 2, "block_size": 8, "drafter_layers": 2, "num_anchors": 48,
    "draft_vocab_size": 8192, "target_layers": (1, 7, 14, 20, 27), "lr": 2e-3,
    "warmup_steps": 20, "eval_prompts": 0,
}  # fmt: skip
LAST = 10  # steps whose mean loss is compared
TOLERANCE = 0.02  # |bf16 - fp32| / fp32 of that mean


def stdlib_rows(count: int, seq_len: int, batch_size: int) -> list[Batch]:
    """`count` batches of byte tokens of the standard library's source, one document a row."""
    text = b"".join(
        p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    )
    ids = torch.tensor(list(text[: count * batch_size * seq_len]), dtype=torch.long)
    rows = ids.view(count, batch_size, seq_len)
    return [Batch(i, rows[i], torch.ones_like(rows[i], dtype=torch.bool)) for i in range(count)]


def features(target: TargetModel, batches: list[Batch], layers: list[int]) -> list[TargetOutput]:
    """The target's states of the chosen layers (computed in bf16, kept in fp32)."""
    with torch.no_grad():
        outs = [target.capture(b.input_ids, layers, with_logits=False) for b in batches]
    return [TargetOutput(o.hidden.float(), None) for o in outs]


def trainer_for(cfg: TrainConfig, target: TargetModel, batches: list[Batch]) -> DrafterTrainer:
    """The recipe's drafter and trainer on `target` (its embedding and head shared)."""
    vocab_size = target.embed_tokens.num_embeddings
    mask_id = vocab_size - 1  # a row the byte data never uses
    size, vocab = cfg.drafter.draft_vocab_size, None
    if size is not None and size < vocab_size:
        ids = torch.cat([b.input_ids for b in batches])
        learnable = torch.ones_like(ids, dtype=torch.bool)
        vocab = select_draft_vocab(ids, learnable, size, vocab_size, (mask_id,))
    config = DrafterConfig.for_target(
        target,
        num_layers=cfg.drafter.num_layers,
        block_size=cfg.drafter.block_size,
        target_layer_ids=list(cfg.target.layer_ids or ()),
        mask_token_id=mask_id,
        draft_vocab_size=vocab.size if vocab is not None else 0,
    )
    torch.manual_seed(cfg.run.seed)
    drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head, vocab)
    return DrafterTrainer(drafter, cfg, "cpu")


def side_by_side(steps: int, count: int, warmup: int) -> dict[str, object]:
    """Both precisions' drafter steps on the same batches and features, in turn."""
    cfg32 = config_from_options({**RECIPE, "steps": steps, "precision": "fp32"})
    cfg16 = dataclasses.replace(
        cfg32, pipeline=dataclasses.replace(cfg32.pipeline, precision="bf16")
    )
    batches = stdlib_rows(count, cfg32.data.seq_len, cfg32.data.batch_size)
    target32 = random_qwen3_target(SMOLLM2_135M, dtype=torch.float32)
    # The same weights in bf16, as run_precision casts them under --precision bf16.
    target16 = run_precision(random_qwen3_target(SMOLLM2_135M), "bf16", torch.device("cpu"))
    start_s = time.perf_counter()
    outs = features(target16, batches, list(cfg32.target.layer_ids))
    features_s = time.perf_counter() - start_s
    runs = {
        "fp32": trainer_for(cfg32, target32, batches),
        "bf16": trainer_for(cfg16, target16, batches),
    }
    assert runs["bf16"].autocast_dtype == torch.bfloat16 and runs["fp32"].autocast_dtype is None
    seconds = dict.fromkeys(runs, 0.0)
    losses: dict[str, list[float]] = {name: [] for name in runs}
    tokens = 0
    for i in range(steps):
        batch, out = batches[i % count], outs[i % count]
        batch = Batch(i, batch.input_ids, batch.loss_mask)  # a new batch id: new anchors
        order = list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]
        for name, trainer in order:
            step_s = time.perf_counter()
            loss = float(trainer.step(batch, out).loss)
            if i >= warmup:
                seconds[name] += time.perf_counter() - step_s
            losses[name].append(loss)
        if i >= warmup:
            tokens += batch.num_tokens
    rate = {name: tokens / s for name, s in seconds.items()}
    last = {name: sum(values[-LAST:]) / len(values[-LAST:]) for name, values in losses.items()}
    difference = last["bf16"] - last["fp32"]
    return {
        "shape": "SmolLM2-135M recipe step (seq 512 x batch 2, block 8, 2 layers, 48 anchors, "
        "draft vocab 8192)",
        "timed_steps": steps - warmup,
        "fp32_tokens_per_s": round(rate["fp32"], 1),
        "bf16_tokens_per_s": round(rate["bf16"], 1),
        "bf16_over_fp32": round(rate["bf16"] / rate["fp32"], 3),
        f"fp32_loss_last{LAST}": round(last["fp32"], 4),
        f"bf16_loss_last{LAST}": round(last["bf16"], 4),
        "loss_difference": round(difference, 4),
        "relative_difference": round(difference / last["fp32"], 4),
        "within_tolerance": abs(difference) <= TOLERANCE * abs(last["fp32"]),
        "tolerance": f"{TOLERANCE:.0%} of fp32's mean loss over the last {LAST} steps",
        "max_step_difference": round(
            max(abs(a - b) for a, b in zip(losses["fp32"], losses["bf16"], strict=True)), 4
        ),
        "loss_curves_every_10": {n: [round(v, 3) for v in vs[::10]] for n, vs in losses.items()},
        "features_s": round(features_s, 1),
    }


def target_forward(reps: int) -> dict[str, object]:
    """The target's forward over one recipe batch (2 x 512 tokens): fp32 weights, fp32
    weights under bf16 autocast, bf16 weights (what --precision bf16 runs)."""
    batch = stdlib_rows(1, 512, 2)[0]
    layers = list(RECIPE["target_layers"])
    out: dict[str, object] = {}
    for name, dtype, autocast in (
        ("fp32", torch.float32, False),
        ("fp32_autocast", torch.float32, True),
        ("bf16_weights", torch.bfloat16, False),
    ):
        target = random_qwen3_target(SMOLLM2_135M)
        if dtype == torch.bfloat16:
            run_precision(target, "bf16", torch.device("cpu"))  # as a run casts it
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            target.capture(batch.input_ids, layers, with_logits=False)  # warm-up
            start_s = time.perf_counter()
            for _ in range(reps):
                target.capture(batch.input_ids, layers, with_logits=False)
            seconds = (time.perf_counter() - start_s) / reps
        out[f"target_{name}_tokens_per_s"] = round(batch.num_tokens / seconds, 1)
        del target
    out["target_bf16_over_fp32"] = round(
        out["target_bf16_weights_tokens_per_s"] / out["target_fp32_tokens_per_s"],
        3,  # type: ignore[operator]
    )
    return out


def width_sweep(widths: list[int], steps: int = 8) -> list[dict[str, object]]:
    """The drafter step's bf16/fp32 ratio at other hidden sizes (1 drafter layer, vocab
    8,192, the recipe's rows), random features: where bf16 starts to pay."""
    rows = []
    for width in widths:
        head_dim = 32 if width < 256 else 64
        heads = width // head_dim
        geometry = dataclasses.replace(
            SMOLLM2_135M, hidden_size=width, num_layers=6, num_heads=heads,
            num_kv_heads=max(1, heads // 3), head_dim=head_dim, intermediate_size=width * 8 // 3,
            vocab_size=8192,
        )  # fmt: skip
        opts = {**RECIPE, "target_layers": (1, 3), "drafter_layers": 1, "draft_vocab_size": None}
        seconds = {}
        for precision in ("fp32", "bf16"):
            cfg = config_from_options({**opts, "steps": steps + 2, "precision": precision})
            target = random_qwen3_target(geometry)
            run_precision(target, precision, torch.device("cpu"))
            batches = stdlib_rows(2, cfg.data.seq_len, cfg.data.batch_size)
            gen = torch.Generator().manual_seed(0)
            hidden = torch.randn(2, 512, 2 * width, generator=gen)
            trainer = trainer_for(cfg, target, batches)
            for i in range(steps + 2):
                if i == 2:
                    start_s = time.perf_counter()
                trainer.step(
                    Batch(i, batches[0].input_ids, batches[0].loss_mask), TargetOutput(hidden, None)
                )
            seconds[precision] = (time.perf_counter() - start_s) / steps
        rows.append(
            {"hidden": width, "bf16_over_fp32": round(seconds["fp32"] / seconds["bf16"], 3)}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of each drafter")
    parser.add_argument("--batches", type=int, default=25, help="distinct batches, cycled")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--target-reps", type=int, default=2, help="timed target forwards (0: skip)"
    )
    parser.add_argument("--widths", default="", help="hidden sizes to sweep, e.g. 128,256,576")
    args = parser.parse_args()
    machine = {
        "threads": torch.get_num_threads(),
        "cpu_bf16_flags": list(cpu_bf16_flags()),
        "matmul_peak_gflops": {
            "fp32": round(cpu_matmul_peak_gflops(torch.float32), 1),
            "bf16": round(cpu_matmul_peak_gflops(torch.bfloat16), 1),
        },
    }
    print(json.dumps({"machine": machine}), flush=True)
    if args.target_reps:
        print(json.dumps({"target_forward": target_forward(args.target_reps)}), flush=True)
    print(
        json.dumps({"drafter_step": side_by_side(args.steps, args.batches, args.warmup)}),
        flush=True,
    )
    if args.widths:
        widths = [int(w) for w in args.widths.split(",")]
        print(json.dumps({"width_sweep": width_sweep(widths)}), flush=True)


if __name__ == "__main__":
    main()
