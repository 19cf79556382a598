"""Keeping drafter replicas identical: in one process and across torchrun ranks.

Every drafter replica (one thread per drafter device, on every rank) computes
gradients on its own batch. Between backward and the optimizer step the trainer
calls its `grad_sync` hook; `GradAverager` makes that hook average the gradients:
first over the replicas of this process (a stop-aware barrier, then replica 0 sums),
then over ranks with one `all_reduce` of a flattened buffer (what DDP does with
its buckets; DDP itself is not used because one process hosts several replicas
in threads, which DDP does not support). Every replica then copies the same
averaged gradient, so the weights stay bit-identical.

Data sharding rule. With W ranks and D drafter replicas per rank, optimizer step s
of a run that starts at batch index i0 consumes the W*D consecutive batch indices
i0 + s*W*D ... i0 + (s+1)*W*D - 1; rank r takes i0 + s*W*D + r + k*W for k < D,
i.e. rank r reads r, r+W, r+2W, ... The batch stream is endless
(`data.PackedDataset.batch(i)` exists for every i: epochs continue row by row into
the next permutation), so no world size "fails to divide" the data: every rank
gets the same number of batches per step, no rank runs dry while another waits in
a collective, and an epoch boundary may fall inside a step exactly as it does in
the single-threaded loop. The resume position after s steps is i0 + s*W*D.

Sharded (`--shard-drafter`): one replica per rank whose parameters, gradients and
AdamW state FSDP2 (`fully_shard`) splits across the ranks. Its reduce-scatter in the
backward already sums the ranks' gradients (and divides by W); `GradAverager` then only
all-reduces the two loss sums and rescales the local shards, so the update is the
same as the replicated one.

Span links across ranks. Each rank's update applies every rank's batches, so its
drafter.optimizer span links to every replica's drafter.step span of the step, on every
rank (`dflash.pipeline.stages.StepPeers`). The ids of those spans ride in the all-reduce
the step makes anyway, as `SpanIds` words after the loss sums: no extra collective.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from opentelemetry.trace import Link, SpanContext, TraceFlags
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

import tracing
from dflash import names
from dflash.errors import DFlashError
from dflash.pipeline.queues import StopAwareBarrier
from dflash.pipeline.stages import StepInProgress, step_in_progress

# A dead peer must not hang a collective for torch's default 30 min; torchrun
# normally tears the group down much sooner when one worker exits.
COLLECTIVE_TIMEOUT_S = 300.0


class DistributedError(DFlashError):
    """Bad torchrun environment or a topology the ranks disagree on."""


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{name}={text!r} is not an integer") from None


def dist_info_from_env(env: Mapping[str, str] | None = None) -> DistInfo:
    """Rank layout from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_*)."""
    env = os.environ if env is None else env
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", world_size)
    local_rank = _env_int(env, "LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise DistributedError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise DistributedError(
            f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size}"
        )
    return DistInfo(rank, world_size, local_rank, local_world_size)


def init_distributed(info: DistInfo, device: torch.device) -> None:
    """Join the process group (gloo for cpu drafters, NCCL for cuda) from env://."""
    if not info.enabled or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def destroy_distributed() -> None:
    """Leave the process group. Only once every thread that may still run a collective
    has been joined: tearing the group down under such a thread aborts the process."""
    if dist.is_initialized():
        dist.destroy_process_group()
        # Free the group's C++ side (its worker threads hold the last tensors they
        # reduced) now, while the interpreter can still take the GIL for them: left
        # to interpreter finalization, that release aborts the process.
        gc.collect()


def check_same_across_ranks(value: int, what: str, device: torch.device) -> None:
    """Fail on every rank when ranks disagree on `value` (they would deadlock later)."""
    if not dist.is_initialized():
        return
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) != value or int(-t[1]) != value:
        raise DistributedError(
            f"ranks disagree on {what}: this rank has {value}, range {int(-t[1])}..{int(t[0])}"
        )


def batch_index(
    step: int, slot: int, rank: int, world_size: int, replicas_per_rank: int, start_index: int = 0
) -> int:
    """Index in the batch stream that `rank` feeds to its `slot`-th replica at `step`
    (counted from the run's start, whose first batch is `start_index`)."""
    per_step = world_size * replicas_per_rank
    return start_index + step * per_step + rank + slot * world_size


def rank_batch_indices(
    num_steps: int, rank: int, world_size: int, replicas_per_rank: int, start_index: int = 0
) -> range:
    """Every batch index `rank` trains on in `num_steps` steps, in order: `batch_index`
    for each step and slot, which is every world_size-th index from start_index + rank.
    A range, so any number of steps costs nothing until the batches are drawn."""
    first = start_index + rank
    return range(first, first + num_steps * replicas_per_rank * world_size, world_size)


def _on_device(words: np.ndarray, device: torch.device) -> torch.Tensor:
    """`words` (float32) as a tensor on `device`; to a GPU through pinned memory,
    asynchronously (a pageable copy would wait for the whole stream, the backward too)."""
    host = torch.from_numpy(words)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


@torch.no_grad()
def sync_initial_weights(replicas: Sequence[nn.Module]) -> None:
    """Start every replica (in this process and on every rank) from rank 0's replica 0."""
    first = replicas[0]
    if dist.is_initialized():
        for tensor in list(first.parameters()) + list(first.buffers()):
            dist.broadcast(tensor.data, src=0)
    for other in replicas[1:]:
        for param, source in zip(other.parameters(), first.parameters(), strict=True):
            param.copy_(source)
        for buffer, kept in zip(other.buffers(), first.buffers(), strict=True):
            buffer.copy_(kept)


def shard_module(
    module: nn.Module, blocks: Sequence[nn.Module], forward_methods: Sequence[str] = ()
) -> None:
    """FSDP2 over the default process group: each of `blocks` (the decoder layers) is
    one unit gathered for its own forward and backward, then the rest as the root.
    Only the module tree's trainable parameters are sharded: modules held outside it
    (the drafter's frozen embedding and LM head, the target's) and frozen parameters
    inside it (a pruned head, read outside any forward) stay whole, never communicated.
    `forward_methods` are methods called in place of forward that need the root's
    parameters gathered as forward has them."""
    for block in blocks:
        fully_shard(block)
    frozen = {p for p in module.parameters() if not p.requires_grad}
    fully_shard(module, ignored_params=frozen or None)
    for name in forward_methods:
        register_fsdp_forward_method(module, name)


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing its storage), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


class CrossRankHook(Protocol):
    """A collective that every rank runs after the same step, when rank 0 asks for it
    (e.g. gathering every rank's interval table). It runs on the training thread
    between steps, never inside a timed phase."""

    def wanted(self) -> bool:
        """Rank 0's request, read before every gradient all-reduce (other ranks' votes
        do not count)."""
        ...

    def run(self) -> None:
        """The collective itself; every rank calls it at the same step."""
        ...


class SpanIds:
    """The drafter.step span ids of one step, every rank's, carried by a sum all-reduce.

    Each rank and replica has a slot of float32 words: the trace id, span id and batch id
    in 16-bit words, zero on every rank but its own. Zeros added to an integer below
    2**24 leave it exact in float32 whatever the order of the sum, so after the
    all-reduce every rank reads every slot as its owner wrote it; a zero span id (never
    a valid one) is a replica that sent none (its span not sampled, tracing off). The
    words go after the gradients and loss sums, which they leave bit for bit as they were.
    """

    BYTES = (16, 8, 8)  # trace id (128 bits), span id, batch id (64): little-endian
    SLOT = sum(BYTES) // 2  # 16-bit words

    def __init__(self, world_size: int, rank: int, replicas: int):
        self.world_size, self.rank, self.replicas = world_size, rank, replicas

    @property
    def size(self) -> int:
        return self.world_size * self.replicas * self.SLOT

    def encode(self, local: Sequence[tuple[int, Link]]) -> np.ndarray:
        """This rank's slots filled with its replicas' links (`StepPeers.local`)."""
        raw = bytearray(self.size * 2)
        for replica, link in local:
            batch_id = (link.attributes or {}).get(names.BATCH_ID)
            values = (link.context.trace_id, link.context.span_id, batch_id)
            at = (self.rank * self.replicas + replica) * self.SLOT * 2
            for value, width in zip(values, self.BYTES, strict=True):
                number = value if isinstance(value, int) and value >= 0 else 0
                raw[at : at + width] = (number % (1 << 8 * width)).to_bytes(width, "little")
                at += width
        return np.frombuffer(raw, dtype="<u2").astype(np.float32)

    def decode(self, words: np.ndarray, step: int) -> list[Link]:
        """Links to the other ranks' spans in the summed `words` (remote, sampled)."""
        raw = np.asarray(words, dtype=np.float32).astype("<u2").tobytes()
        links, (trace_end, span_end, slot_end) = [], np.cumsum(self.BYTES).tolist()
        for rank in (r for r in range(self.world_size) if r != self.rank):
            for replica in range(self.replicas):
                at = (rank * self.replicas + replica) * self.SLOT * 2
                slot = raw[at : at + slot_end]
                trace_id = int.from_bytes(slot[:trace_end], "little")
                span_id = int.from_bytes(slot[trace_end:span_end], "little")
                if trace_id == 0 or span_id == 0:
                    continue
                flags = TraceFlags(TraceFlags.SAMPLED)
                context = SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)
                batch_id = int.from_bytes(slot[span_end:], "little")
                attributes = {names.STEP: step, names.BATCH_ID: batch_id, names.RANK: rank}
                links.append(Link(context, attributes))
        return links


class GradAverager:
    """Combines the gradients of the replicas of this process and of the ranks, per step.

    Each replica hands over its gradients of sum(w*l), undivided, with that sum and the
    loss's denominator (sum(w), or the scored blocks): all three are summed over replicas
    and ranks in one all-reduce and the gradients divided by the total denominator once.
    So a replica with 10 scored positions and one with 1 weigh 10:1, as they would in one
    batch: averaging replicas' own means would give the lone position 5.5x its weight.

    Across ranks, one extra element of the all-reduce carries rank 0's request for
    the `cross_rank_hook`, so all ranks learn it at the same step with no extra
    collective; replica 0 then runs the hook in `after_step`, outside the step. The
    same all-reduce carries the step's span ids (`SpanIds`) for the updates' links.
    """

    def __init__(
        self,
        replicas: Sequence[nn.Module],
        stop: threading.Event,
        cross_rank_hook: CrossRankHook | None = None,
    ):
        self._params = [trainable_parameters(m) for m in replicas]
        sizes = {tuple(p.numel() for p in ps) for ps in self._params}
        assert len(sizes) == 1, "replicas must have the same trainable parameters"
        self._barrier = StopAwareBarrier(len(replicas), stop)
        self._world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._average: torch.Tensor | None = None
        self._sums: list[torch.Tensor | None] = [None] * len(replicas)  # [w*l, denominator]
        self._loss: torch.Tensor | None = None
        self._hook = cross_rank_hook if self._world_size > 1 else None
        self._requested: torch.Tensor | None = None  # the request element, left on the device
        self._sharded = is_sharded(replicas[0])
        if self._sharded and len(replicas) != 1:
            raise DistributedError("a sharded drafter trains as one replica per rank")
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._ids = SpanIds(self._world_size, rank, len(replicas))

    def _all_reduce(self, total: torch.Tensor) -> torch.Tensor:
        """`total` summed over ranks, in one all-reduce with the span ids of this
        thread's step and rank 0's request for the hook after it."""
        step = step_in_progress()
        words = self._ids.encode(step.peers.local(step.number) if step is not None else ())
        if self._hook is not None:
            is_main = dist.get_rank() == 0
            words = np.append(words, np.float32(is_main and self._hook.wanted()))
        total = torch.cat([total, _on_device(words, total.device)])
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        size = total.numel() - words.size
        if self._hook is not None:
            self._requested = total[-1]
        if step is not None:
            self._share_remote(step, total[size : size + self._ids.size])
        return total[:size]

    def _share_remote(self, step: StepInProgress, ids: torch.Tensor) -> None:
        """Hands the other ranks' span ids of `step` to its updates, to read if they
        record. Reading a device's result waits for the all-reduce: the copy starts now,
        the wait comes only when a recording update asks, after it is queued."""
        if not step.peers.local(step.number):
            return  # no span of this step sampled here: no update of it records links
        done: torch.cuda.Event | None = None
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(ids.device))  # the copy's stream
        else:
            host = ids.clone()  # not a view that keeps the whole gradient buffer alive
        number, span_ids = step.number, self._ids

        def read() -> list[Link]:
            if done is not None:
                done.synchronize()
            return span_ids.decode(host.numpy(), number)

        step.peers.set_remote(number, read)

    def after_step(self, may_read: bool) -> None:
        """Replica 0, after its step: runs the cross-rank hook if rank 0 asked for it.

        Reading the request is a device-to-host copy, so it happens only where
        `may_read` (the logged steps, which read the device anyway); every rank
        logs the same steps, so every rank runs the hook at the same one.
        """
        requested, self._requested = self._requested, None
        if may_read and requested is not None and requested.item() > 0:
            assert self._hook is not None
            self._hook.run()

    @property
    def needed(self) -> bool:
        return len(self._params) > 1 or self._world_size > 1

    def hook(self, replica: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The `grad_sync` callable for replica `replica` (0 leads the reduction)."""
        return lambda weighted, denominator: self.sync(replica, weighted, denominator)

    def _flat_grads(self, replica: int, device: torch.device) -> torch.Tensor:
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device)
            for p in self._params[replica]
        ]
        return torch.cat(parts).float()

    @torch.no_grad()
    def sync(self, replica: int, weighted: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        """Replica `replica`'s part of one step: its gradients become those of every
        replica's loss together; -> that loss, sum(w*l) / denominator over all."""
        if self._sharded:
            return self._sync_sharded(weighted, denominator)
        own_device = weighted.device
        self._sums[replica] = torch.stack([weighted.float(), denominator.float()])
        with tracing.phase(names.GRAD_SYNC_WAIT):
            self._barrier.wait()  # every replica's backward is done
        if replica == 0:
            device = self._params[0][0].device
            total = self._flat_grads(0, device)
            attributes = {names.GRAD_BYTES: total.numel() * 4, names.WORLD_SIZE: self._world_size}
            with tracing.phase(names.GRAD_SYNC_REDUCE, attributes=attributes):
                for other in range(1, len(self._params)):
                    total += self._flat_grads(other, device)
                sums = torch.stack([s.to(device) for s in self._sums if s is not None]).sum(0)
                if self._world_size > 1:
                    reduced = self._all_reduce(torch.cat([total, sums]))
                    total, sums = reduced[:-2], reduced[-2:]
                divide_by = sums[1].clamp(min=1e-8)
                self._average, self._loss = total / divide_by, sums[0] / divide_by
        with tracing.phase(names.GRAD_SYNC_WAIT):
            self._barrier.wait()  # the result is ready; nobody overwrites it before the next step
        assert self._average is not None and self._loss is not None
        offset = 0
        for p in self._params[replica]:
            chunk = self._average[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(chunk)
        return self._loss.to(own_device)

    def _sync_sharded(self, weighted: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        """FSDP2 left each rank the mean over ranks of its shard of the gradients of
        sum(w*l): times W it is the sum, divided once by the denominator of all ranks."""
        sums = torch.stack([weighted.float(), denominator.float()])
        attributes = {names.GRAD_BYTES: sums.numel() * 4, names.WORLD_SIZE: self._world_size}
        with tracing.phase(names.GRAD_SYNC_REDUCE, attributes=attributes):
            if self._world_size > 1:
                sums = self._all_reduce(sums)
            divide_by = sums[1].clamp(min=1e-8)
            grads = [local_tensor(p.grad) for p in self._params[0] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self._world_size / divide_by)
        return sums[0] / divide_by
