"""Offline hidden-state cache: run the target once, train from disk afterwards.

`train --hidden-cache DIR` plugs `HiddenCacheReader.read` into the pipeline as the
target stage's forward (traced as target.read): the batches, with their document
ids and positions, still come from the dataset; only the target's features come
from disk.

Layout of a cache directory:
  index.json               fingerprint of what was cached, and the finished shards
  shard-00000.safetensors  batches [0, S): `hidden.{i}` [B, T, K*D] in the target's
                           dtype, `input_ids.{i}` [B, T], and `final.{i}` [B, T, D]
                           (the final-norm state, for soft labels) when asked for
A shard is written to a temporary name, checksummed, renamed, and only then listed
in the index, so an interrupted write leaves a valid shorter cache that the next
`write_hidden_cache` call continues. Batch i of the cache is batch i of the dataset
it was written from; the reader refuses a cache of another target, layer set,
tokenizer or data, and a truncated or corrupt shard.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from dflash.data.datasets import Batch, PackedDataset
from dflash.data.sources import DataError
from dflash.data.tokenizer import tokenizer_fingerprint
from dflash.files import replacing, sha256_file, write_failure, write_json_atomic
from dflash.log import Log
from dflash.offline.config import BATCHES_PER_SHARD
from dflash.summary import JSON
from dflash.target.model import TargetModel, TargetOutput, target_fingerprint

FORMAT_VERSION = 1
INDEX_NAME = "index.json"
WRITE_FAILURES = (OSError, SafetensorError)
"""What a failed write of a cache file raises (a full disk: ENOSPC, or EFBIG past a
file size limit; safetensors reports them as SafetensorError)."""


class HiddenCacheError(DataError):
    """A hidden-state cache that cannot be used or written; one line naming why."""


# --------------------------------------------------------------------------- fingerprint


def cache_fingerprint(
    target: TargetModel, dataset: PackedDataset, *, layer_ids: list[int], with_final_norm: bool
) -> JSON:
    """Everything a cached hidden state depends on."""
    return {
        "format": FORMAT_VERSION,
        "target": target.spec,
        "target_hash": target_fingerprint(target),
        "dtype": str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        "layer_ids": list(layer_ids),
        "tokenizer": tokenizer_fingerprint(target.tokenizer),
        "data": dataset.fingerprint(),
        "seq_len": dataset.seq_len,
        "batch_size": dataset.batch_size,
        "packing": dataset.packing,
        "final_norm": with_final_norm,
    }


_WHAT = {
    "target": "target",
    "target_hash": "target weights",
    "dtype": "target dtype",
    "layer_ids": "target layers",
    "tokenizer": "tokenizer",
    "seq_len": "--seq-len",
    "batch_size": "--batch-size",
    "packing": "--packing",
    "final_norm": "final-norm states (soft labels)",
    "data": "data",  # after the options that change it, so the message names the option
    "format": "cache format",
}


def _check_fingerprint(directory: Path, saved: JSON, wanted: JSON) -> None:
    order = list(_WHAT)
    for key in sorted(wanted, key=lambda k: order.index(k) if k in order else len(order)):
        value = wanted[key]
        if saved.get(key) != value:
            raise HiddenCacheError(
                f"hidden cache {directory} was written for another {_WHAT.get(key, key)}: "
                f"it has {saved.get(key)!r}, this run {value!r}"
            )


# --------------------------------------------------------------------------- index


def _read_index(directory: Path) -> JSON | None:
    path = directory / INDEX_NAME
    if not path.exists():
        return None
    try:
        index = json.loads(path.read_text())
        index["fingerprint"], index["shards"]  # noqa: B018 - shape check
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise HiddenCacheError(f"hidden cache index {path} is unreadable: {err}") from err
    return index


def cached_batches(index: JSON) -> int:
    return sum(int(s["num_batches"]) for s in index["shards"])


# --------------------------------------------------------------------------- writing


def _capture(
    target: TargetModel, batch: Batch, layer_ids: list[int], with_final_norm: bool
) -> tuple[Tensor, Tensor | None]:
    """hidden[B, T, K*D] and, when asked, the final-norm state [B, T, D] (the LM head's input)."""
    ids = batch.input_ids.to(target.device)
    docs = None if batch.doc_ids is None else batch.doc_ids.to(target.device)
    out = target.capture(
        ids, layer_ids, with_logits=False, with_final_hidden=with_final_norm, doc_ids=docs
    )
    return out.hidden, out.final_hidden


def _open_for_writing(directory: Path, fingerprint: JSON) -> JSON:
    index = _read_index(directory)
    if index is not None:
        _check_fingerprint(directory, index["fingerprint"], fingerprint)
        return index
    if directory.exists() and any(not p.name.startswith(".") for p in directory.iterdir()):
        raise HiddenCacheError(f"--output {directory} exists and is not a hidden-state cache")
    directory.mkdir(parents=True, exist_ok=True)
    return {"fingerprint": fingerprint, "shards": []}


def write_hidden_cache(
    target: TargetModel,
    dataset: PackedDataset,
    output_dir: Path | str,
    *,
    layer_ids: list[int],
    num_batches: int,
    with_final_norm: bool = False,
    batches_per_shard: int = BATCHES_PER_SHARD,
    progress: Callable[[int, int], None] | None = None,
    log: Log | None = None,
) -> Path:
    """Cache batches [0, num_batches) of `dataset`; continues an interrupted cache.

    A cache written before is verified first, every shard against its size and checksum
    in the index; a missing or damaged one is written again (`log` says which), so a
    rerun, as a reader's error advises, repairs it. `progress(done, total)` is called
    after every shard.
    """
    if num_batches < 1 or batches_per_shard < 1:
        raise HiddenCacheError(
            f"need num_batches >= 1 and batches_per_shard >= 1, "
            f"got {num_batches} and {batches_per_shard}"
        )
    directory = Path(output_dir)
    fingerprint = cache_fingerprint(
        target, dataset, layer_ids=layer_ids, with_final_norm=with_final_norm
    )
    index = _open_for_writing(directory, fingerprint)
    shard_of = _ShardWriter(target, dataset, directory, layer_ids, with_final_norm)
    writing = directory / INDEX_NAME  # the file a failed write was writing
    done = 0
    try:
        for position, shard in enumerate(index["shards"]):
            why = shard_damage(directory, shard)
            if why is not None:
                first, count = shard["first_batch"], shard["num_batches"]
                writing = directory / shard["file"]
                index["shards"][position] = shard_of(shard["file"], first, count)
                writing = directory / INDEX_NAME
                write_json_atomic(writing, index)
                if log is not None:
                    log(f"cache-hidden: {directory / shard['file']} was {why}: written again")
        done = cached_batches(index)
        while done < num_batches:
            count = min(batches_per_shard, num_batches - done)
            name = f"shard-{len(index['shards']):05d}.safetensors"
            writing = directory / name
            shard = shard_of(name, done, count)
            writing = directory / INDEX_NAME
            write_json_atomic(writing, {**index, "shards": [*index["shards"], shard]})
            index["shards"].append(shard)
            done += count
            if progress is not None:
                progress(done, num_batches)
    except WRITE_FAILURES as exc:  # a full disk: the line train gives at a checkpoint
        raise HiddenCacheError(
            f"{write_failure(exc, writing)}: the cache's first {done} of {num_batches} "
            "batches are complete; the same command continues after them once there is room"
        ) from None
    return directory


def shard_damage(directory: Path, shard: JSON) -> str | None:
    """What is wrong with a listed shard's file (missing, truncated, corrupt), or None."""
    path = directory / shard["file"]
    size = path.stat().st_size if path.is_file() else -1
    if size < 0:
        return "missing"
    if size != shard["bytes"]:
        return f"truncated ({size} of {shard['bytes']} bytes)"
    if sha256_file(path) != shard["sha256"]:
        return "corrupt (checksum mismatch)"
    return None


class _ShardWriter:
    """Writes the shard of batches [first, first + count): its index entry."""

    def __init__(
        self,
        target: TargetModel,
        dataset: PackedDataset,
        directory: Path,
        layer_ids: list[int],
        with_final_norm: bool,
    ) -> None:
        self.target, self.dataset, self.directory = target, dataset, directory
        self.layer_ids, self.with_final_norm = layer_ids, with_final_norm

    def __call__(self, name: str, first: int, count: int) -> JSON:
        tensors: dict[str, Tensor] = {}
        for i in range(first, first + count):
            batch = self.dataset.batch(i)
            hidden, final = _capture(self.target, batch, self.layer_ids, self.with_final_norm)
            tensors[f"hidden.{i}"] = hidden.contiguous().cpu()
            tensors[f"input_ids.{i}"] = batch.input_ids.to(torch.int32).contiguous()
            if final is not None:
                tensors[f"final.{i}"] = final.contiguous().cpu()
        with replacing(self.directory / name) as tmp:
            save_file(tensors, str(tmp))
            digest, size = sha256_file(tmp), tmp.stat().st_size
        shard = {"file": name, "first_batch": first, "num_batches": count}
        return {**shard, "bytes": size, "sha256": digest}


# --------------------------------------------------------------------------- reading


class HiddenCacheReader:
    """(batch, target_out) of batch i, as the online target forward would give them.

    Thread contract: `get` may be called from several threads; shard files are
    checksummed once, on first use (sizes are checked when opening).
    """

    def __init__(self, directory: Path, index: JSON, dataset: PackedDataset) -> None:
        self.directory, self.index, self.dataset = directory, index, dataset
        self.num_batches = cached_batches(index)
        self._handles: dict[str, safe_open] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0  # tensor bytes handed out by `read`
        for shard in index["shards"]:
            path = directory / shard["file"]
            size = path.stat().st_size if path.exists() else -1
            if size != shard["bytes"]:
                raise HiddenCacheError(
                    f"hidden cache shard {path} is truncated or missing "
                    f"({max(size, 0)} of {shard['bytes']} bytes): rerun cache-hidden"
                )

    @property
    def total_bytes(self) -> int:
        return sum(int(s["bytes"]) for s in self.index["shards"])

    def _shard(self, index: int) -> safe_open:
        for shard in self.index["shards"]:
            if shard["first_batch"] <= index < shard["first_batch"] + shard["num_batches"]:
                break
        else:
            raise HiddenCacheError(
                f"hidden cache {self.directory} holds batches 0..{self.num_batches - 1}, "
                f"batch {index} was asked for: write more with cache-hidden --num-batches"
            )
        with self._lock:
            if shard["file"] not in self._handles:
                path = self.directory / shard["file"]
                if sha256_file(path) != shard["sha256"]:
                    raise HiddenCacheError(
                        f"hidden cache shard {path} is corrupt (checksum mismatch): "
                        "rerun cache-hidden"
                    )
                try:
                    self._handles[shard["file"]] = safe_open(str(path), framework="pt")
                except (OSError, SafetensorError) as err:
                    raise HiddenCacheError(
                        f"hidden cache shard {path} is unreadable: {err}"
                    ) from err
            return self._handles[shard["file"]]

    def covers(self, last_index: int) -> None:
        """Refuses a run that would need batch `last_index` when the cache stops earlier."""
        if last_index >= self.num_batches:
            raise HiddenCacheError(
                f"--hidden-cache {self.directory} holds {self.num_batches} batches, this run "
                f"reads up to batch {last_index}: write more with cache-hidden --num-batches "
                f"{last_index + 1}"
            )

    def verify(self, first_index: int, last_index: int) -> None:
        """Checksums (and opens) every shard holding batches first..last, now: a damaged
        shard stops the run before its first step, not at the step that reaches it. Each
        shard is hashed once: later reads find it open."""
        for shard in self.index["shards"]:
            start = shard["first_batch"]
            if start <= last_index and start + shard["num_batches"] > first_index:
                self._shard(start)

    def read(self, batch: Batch, lm_head: torch.nn.Module | None = None) -> TargetOutput:
        """The cached features of `batch` (batch.batch_id is its index): hidden, and the
        final-norm state when cached; logits = lm_head(final-norm state) when `lm_head`
        is given (soft labels from logits; the cache must hold final-norm states)."""
        index = batch.batch_id
        handle = self._shard(index)
        if not torch.equal(handle.get_tensor(f"input_ids.{index}").long(), batch.input_ids):
            raise HiddenCacheError(
                f"hidden cache {self.directory}: batch {index} holds other tokens than the data"
            )
        hidden = handle.get_tensor(f"hidden.{index}")
        has_final = bool(self.index["fingerprint"]["final_norm"])
        final = handle.get_tensor(f"final.{index}") if has_final else None
        logits = None
        if lm_head is not None:
            if final is None:
                raise HiddenCacheError(
                    f"hidden cache {self.directory} has no final-norm states: "
                    "write it with soft labels on"
                )
            with torch.no_grad():
                logits = lm_head(final.to(lm_head.weight.device))
        size = hidden.numel() * hidden.element_size()
        size += 0 if final is None else final.numel() * final.element_size()
        with self._lock:
            self.bytes_read += size
        return TargetOutput(hidden=hidden, logits=logits, final_hidden=final)

    def get(self, index: int, lm_head: torch.nn.Module | None = None) -> tuple[Batch, TargetOutput]:
        """Batch `index` of the dataset and its cached features (see `read`)."""
        batch = self.dataset.batch(index)
        return batch, self.read(batch, lm_head)


def open_hidden_cache(
    directory: Path | str,
    *,
    target: TargetModel,
    dataset: PackedDataset,
    layer_ids: list[int],
    with_final_norm: bool = False,
) -> HiddenCacheReader:
    """A reader of `directory`, refused unless it was written for exactly this run's
    target, layers, tokenizer and data."""
    path = Path(directory)
    index = _read_index(path)
    if index is None:
        raise HiddenCacheError(f"--hidden-cache {path}: no {INDEX_NAME} (not a hidden-state cache)")
    wanted = cache_fingerprint(
        target, dataset, layer_ids=layer_ids, with_final_norm=with_final_norm
    )
    if not with_final_norm:  # a cache with final-norm states also serves runs without them
        wanted.pop("final_norm")
    _check_fingerprint(path, index["fingerprint"], wanted)
    return HiddenCacheReader(path, index, dataset)
