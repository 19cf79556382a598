"""A pruned draft vocabulary against the whole one: loss-step tokens/s side by side in one
run, and (with --tau-steps) τ of a drafter trained each way on the same data.

Usage:
  python bench/draft_vocab.py target=DIR data=regen.jsonl [KEY=VALUE ...]
      [--fraction 0.25] [--steps 12] [--warmup 2]
      [--tau-steps 400 --eval-data heldout.jsonl --eval-prompts 16 --eval-new-tokens 96]
  DIR: a Hugging Face chat model with V >= 32K (e.g. SmolLM2-135M-Instruct, 49,152 tokens;
  docs/benchmarks.md says where one comes from); KEY=VALUE are train options.

The speed part times DrafterTrainer.step (block prediction, loss, backward, optimizer) on
the same batches and target features for both drafters, alternating, so machine noise
hits both alike; the target's forward is run once, untimed. The τ part trains and
evaluates with the CLI, one run after the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import parse_overrides  # noqa: E402

from dflash.config.devices import decide_placement  # noqa: E402
from dflash.config.settings import TrainConfig, config_from_options  # noqa: E402
from dflash.run.build import build_run  # noqa: E402


def with_vocab(cfg: TrainConfig, size: int | None) -> TrainConfig:
    return dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, draft_vocab_size=size))


def speed(cfg: TrainConfig, fraction: float, steps: int, warmup: int) -> dict[str, object]:
    full = build_run(cfg, decide_placement(cfg.pipeline), log=lambda s: None)
    vocab = full.target.embed_tokens.num_embeddings
    size = max(1, int(vocab * fraction))
    lines: list[str] = []
    pruned = build_run(with_vocab(cfg, size), decide_placement(cfg.pipeline), log=lines.append)
    soft = cfg.loss.use_soft_labels
    inputs = []
    for i in range(warmup + steps):
        batch = full.train_data.batch(i)
        with torch.no_grad():
            out = full.target.capture(batch.input_ids, full.layer_ids, with_logits=False,
                                      with_final_hidden=soft)  # fmt: skip
        inputs.append((batch, out))
    seconds = {"full": 0.0, "pruned": 0.0}
    tokens = 0
    for i, (batch, out) in enumerate(inputs):
        order = [("full", full), ("pruned", pruned)]
        for name, run in order if i % 2 == 0 else order[::-1]:
            start_s = time.perf_counter()
            run.trainer.step(batch, out)
            if i >= warmup:
                seconds[name] += time.perf_counter() - start_s
        if i >= warmup:
            tokens += batch.num_tokens
    full_tps, pruned_tps = tokens / seconds["full"], tokens / seconds["pruned"]
    said = next((s for s in lines if s.startswith("draft vocabulary")), "")
    return {
        "vocab_size": vocab, "draft_vocab_size": size,
        "full_tokens_per_s": round(full_tps, 1), "pruned_tokens_per_s": round(pruned_tps, 1),
        "ratio": round(pruned_tps / full_tps, 3), "timed_steps": steps,
        "threads": torch.get_num_threads(), "coverage_line": said,
    }  # fmt: skip


def flags(overrides: dict[str, object]) -> list[str]:
    out: list[str] = []
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [] if value is False else [flag, str(value)]
    return out


def tau(overrides: dict[str, object], size: int | None, args: argparse.Namespace,
        workdir: Path) -> dict[str, object]:  # fmt: skip
    name = "full" if size is None else f"pruned-{size}"
    out = workdir / name
    train = {**overrides, "steps": args.tau_steps, "output_dir": out, "eval_prompts": 0}
    if size is not None:
        train["draft_vocab_size"] = size
    start_s = time.perf_counter()
    subprocess.run(["dflash-train", "train", *flags(train)], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    train_s = time.perf_counter() - start_s
    report = out / "eval.json"
    subprocess.run(["dflash-train", "eval", "--drafter", str(out / "drafter"),
                    "--eval-data", args.eval_data, "--eval-prompts", str(args.eval_prompts),
                    "--max-new-tokens", str(args.eval_new_tokens), "--json", str(report)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    result = json.loads(report.read_text())
    return {"run": name, "train_s": round(train_s, 1), "tau": result.get("tau"),
            "tau_pooled": result.get("tau_pooled")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.25, help="draft vocabulary / V")
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each drafter")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--tau-steps", type=int, default=0, help="train steps of the τ part")
    parser.add_argument("--eval-data", help="chat JSONL of held-out prompts for the τ part")
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--eval-new-tokens", type=int, default=96)
    parser.add_argument("--workdir", help="where the τ part's runs go (default: a temp dir)")
    parser.add_argument("overrides", nargs="*", help="train options as KEY=VALUE")
    args = parser.parse_args()
    overrides = parse_overrides(args.overrides)
    figures = speed(config_from_options(overrides), args.fraction, args.steps, args.warmup)
    print(json.dumps({"speed": figures}), flush=True)
    if args.tau_steps:
        if not args.eval_data:
            parser.error("--tau-steps needs --eval-data")
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="draft-vocab-"))
        rows = [tau(overrides, size, args, workdir)
                for size in (None, int(figures["draft_vocab_size"]))]  # fmt: skip
        ratio = rows[1]["tau"] / rows[0]["tau"] if rows[0]["tau"] else None
        print(json.dumps({"tau": rows, "pruned_over_full": ratio and round(ratio, 3)}))


if __name__ == "__main__":
    main()
