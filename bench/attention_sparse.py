"""Block-sparse vs dense drafter attention on CPU, side by side in one run.

The drafter's training attention at T=1,024 context keys with 128 anchors of block
size 16 (2,048 block queries): the dense path masks a [2,048, 3,072] score matrix per
head, the grouped path computes each group's context prefix plus its own block only.
Prints the median time of the forward and of forward+backward per path, the speedup
and the largest difference of the outputs.

    python bench/attention_sparse.py [--reps 7] [--heads 8] [--head-dim 64] [--threads 1]

One intra-op thread by default: on oversubscribed shared cores every parallel kernel
waits for its slowest thread, which punishes the grouped path's many small kernels
and measures the machine's load rather than the work; pass --threads 2 to see it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash.drafter.attention import BlockLayout, block_sparse_attention
from dflash.objective.blocks import select_anchors


def make_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(args.batch, args.context, dtype=torch.bool)
    anchors, keep = select_anchors(mask, args.anchors, gen)
    q_len = args.anchors * args.block_size
    q = torch.randn(args.batch, args.heads, q_len, args.head_dim, generator=gen)
    k = torch.randn(args.batch, args.heads, args.context + q_len, args.head_dim, generator=gen)
    v = torch.randn_like(k)
    return q, k, v, BlockLayout(anchors, keep, args.context, args.block_size)


def run_once(backend: str, inputs: tuple, backward: bool) -> tuple[float, torch.Tensor]:
    q, k, v, layout = inputs
    leaves = [x.detach().requires_grad_(backward) for x in (q, k, v)]
    start = time.perf_counter()
    out = block_sparse_attention(*leaves, layout, backend=backend)
    if backward:
        out.sum().backward()
    return time.perf_counter() - start, out.detach()


def compare(inputs: tuple, reps: int, backward: bool) -> tuple[float, float, float]:
    """Median seconds of dense and grouped, interleaved so shared-core noise hits both."""
    times: dict[str, list[float]] = {"dense": [], "grouped": []}
    outs = {}
    for rep in range(reps + 1):  # the first round warms up allocator and kernels
        for backend in times:
            seconds, outs[backend] = run_once(backend, inputs, backward)
            if rep:
                times[backend].append(seconds)
    diff = (outs["dense"] - outs["grouped"]).abs().max().item()
    return statistics.median(times["dense"]), statistics.median(times["grouped"]), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inputs = make_inputs(args)
    print(f"T={args.context} anchors={args.anchors} block={args.block_size} "
          f"batch={args.batch} heads={args.heads} head_dim={args.head_dim} "
          f"threads={torch.get_num_threads()}")  # fmt: skip
    print(f"{'pass':<18}{'dense ms':>10}{'grouped ms':>12}{'speedup':>9}{'max |diff|':>12}")
    for backward in (False, True):
        dense_s, sparse_s, diff = compare(inputs, args.reps, backward)
        name = "forward+backward" if backward else "forward"
        print(f"{name:<18}{dense_s * 1e3:>10.1f}{sparse_s * 1e3:>12.1f}"
              f"{dense_s / sparse_s:>8.1f}x{diff:>12.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
