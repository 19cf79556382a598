"""Peak memory of one training step: dense logits + dense mask vs chunked loss + sparse attention.

The target is a Qwen3-shaped model with random weights and a 32,768-row vocabulary
(`dflash.target.synthetic.TINY_QWEN3`), seq 1,024, one row, block size 16, one drafter
layer; 16 vs 256 anchors, hard labels (CE) and soft labels. Each case runs in its own
subprocess and reports its peak RSS (ru_maxrss), so cases do not share an allocator.

dense:   target logits through the step, drafter logits [B, N, Bs, V], `dflash_loss`,
         the dense attention mask (the behaviour before the chunked path existed).
chunked: target final-norm states, `DFlashDrafter.hidden_states`, `chunked_dflash_loss`
         (default chunk), grouped block-sparse attention.

    python bench/loss_memory.py            # all cases, side by side
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

SEQ_LEN, BLOCK_SIZE, DRAFTER_LAYERS = 1024, 16, 1
CASES = [(m, s, n) for s in (False, True) for m in ("dense", "chunked") for n in (16, 256)]


def run_case(mode: str, soft: bool, anchors: int) -> dict[str, float]:
    import torch

    from dflash.config.settings import LossConfig
    from dflash.drafter.model import DFlashDrafter, DrafterConfig
    from dflash.objective.blocks import (
        block_labels,
        build_blocks,
        gather_target_logits,
        select_anchors,
    )
    from dflash.objective.loss import chunked_dflash_loss, gather_target_hidden
    from dflash.objective.reference import dflash_loss
    from dflash.target.synthetic import TINY_QWEN3, random_qwen3_target

    target = random_qwen3_target(TINY_QWEN3)
    cfg = DrafterConfig.for_target(target, num_layers=DRAFTER_LAYERS, block_size=BLOCK_SIZE,
                                   mask_token_id=TINY_QWEN3.vocab_size - 1)  # fmt: skip
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    drafter.attention_backend = "dense" if mode == "dense" else "grouped"
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_QWEN3.vocab_size - 1, (1, SEQ_LEN), generator=gen)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchor_pos, keep = select_anchors(loss_mask, anchors, gen)
    blocks = build_blocks(ids, anchor_pos, BLOCK_SIZE, drafter.mask_id)
    labels, valid = block_labels(ids, loss_mask, anchor_pos, keep, BLOCK_SIZE)
    loss_cfg = LossConfig(use_soft_labels=soft)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layers = cfg.target_layer_ids
    if mode == "dense":
        out = target.capture(ids, layers, with_logits=soft)
        logits = drafter(out.hidden, blocks, anchor_pos, keep)  # [1, N, Bs, V]
        target_logits = gather_target_logits(out.logits, anchor_pos, BLOCK_SIZE) if soft else None
        loss = dflash_loss(logits.float(), labels, valid, loss_cfg, target_logits).loss
    else:
        out = target.capture(ids, layers, with_logits=False, with_final_hidden=soft)
        states = drafter.hidden_states(out.hidden, blocks, anchor_pos, keep)  # [1, N, Bs, D]
        t_states = gather_target_hidden(out.final_hidden, anchor_pos, BLOCK_SIZE) if soft else None
        loss = chunked_dflash_loss(states, drafter.lm_head, labels, valid, loss_cfg, t_states).loss
    loss.backward()
    opt.step()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"before_gb": before_kib / 2**20, "peak_gb": peak_kib / 2**20, "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="mode,soft,anchors: run one case and print JSON")
    args = parser.parse_args()
    if args.case:
        mode, soft, anchors = args.case.split(",")
        print(json.dumps(run_case(mode, soft == "1", int(anchors))))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    peaks: dict[tuple[str, bool, int], float] = {}
    for mode, soft, anchors in CASES:
        case = f"{mode},{int(soft)},{anchors}"
        done = subprocess.run([sys.executable, __file__, "--case", case], env=env, check=True,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        peaks[mode, soft, anchors] = json.loads(done.stdout.splitlines()[-1])["peak_gb"]
    print(f"seq {SEQ_LEN}, batch 1, block {BLOCK_SIZE}, vocab 32,768, peak RSS in GB")
    print(f"{'labels':<8}{'path':<9}{'16 anchors':>11}{'256 anchors':>12}{'growth':>8}")
    for soft in (False, True):
        growth = {}
        for mode in ("dense", "chunked"):
            low, high = peaks[mode, soft, 16], peaks[mode, soft, 256]
            growth[mode] = high - low
            label = "soft" if soft else "CE"
            print(f"{label:<8}{mode:<9}{low:>11.2f}{high:>12.2f}{high - low:>+8.2f}")
        ratio = growth["chunked"] / growth["dense"] if growth["dense"] > 0 else float("nan")
        print(f"{'':<8}chunked growth / dense growth = {ratio:.2f} (bar: <= 0.25)")


if __name__ == "__main__":
    main()
