"""One hs_{i}.safetensors sample file: its header parsed once, its tensors read one by one.

The safetensors format: 8 bytes, a little-endian u64 N; N bytes of JSON, {name: {dtype,
shape, data_offsets: [begin, end]}, "__metadata__": {...}}, the offsets counted from the
end of the header; then the data. The header is parsed here, not by safe_open: opening
100K small files through safe_open costs more than reading them, and a pread at the
header's offsets reads one tensor's bytes and nothing else.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dflash.data.sources import DataError

HIDDEN = "hidden_states"
VERIFIER = "verifier_last_hidden_states"  # flat files: the last layer, apart
LOSS_MASK = "loss_mask"

# safetensors' dtype names; a tensor of another dtype is kept in the table, never read.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# A length past this is a corrupt first 8 bytes, not a header worth reading.
_MAX_HEADER_BYTES = 100 * 2**20


class SampleCacheError(DataError):
    """Sample files that cannot train this run; one line naming both values."""


def dtype_name(code: str) -> str:
    """torch's name of a safetensors dtype (`F32` -> `float32`), as errors say it."""
    known = DTYPES.get(code)
    return code.lower() if known is None else str(known).removeprefix("torch.")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the header: where its bytes lie in the file."""

    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def _entry(path: Path, name: str, raw: object, data_start: int) -> TensorEntry:
    """A header entry, checked for the shape of one: an OSError otherwise."""
    fields = raw if isinstance(raw, dict) else {}
    dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    ints = isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
    span = (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)
    )
    if not (isinstance(dtype, str) and ints and span and 0 <= offsets[0] <= offsets[1]):
        raise OSError(f"{path.name}: header entry {name!r} is not a tensor's ({raw!r:.80})")
    entry = TensorEntry(dtype, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0])
    known = DTYPES.get(dtype)
    if known is not None:
        want = math.prod(entry.shape) * known.itemsize
        if want != entry.nbytes:
            raise OSError(
                f"{path.name}: header gives {name} shape {list(entry.shape)} in {dtype} "
                f"({want} bytes) but offsets {offsets} ({entry.nbytes} bytes)"
            )
    return entry


def _tensor_table(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors of a safetensors file from its header alone, and its metadata. A file
    that is not whole (truncated, a corrupt header, offsets past its end) is an OSError
    naming it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise OSError(f"{path.name}: {size} bytes, not a safetensors file")
        n = struct.unpack("<Q", head)[0]
        if 8 + n > size or n > _MAX_HEADER_BYTES:
            raise OSError(f"{path.name}: header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise OSError(f"{path.name}: header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise OSError(f"{path.name}: header is JSON but not a safetensors header")
    metadata = header.pop("__metadata__", None)
    metadata = metadata if isinstance(metadata, dict) else {}
    table = {name: _entry(path, name, raw, 8 + n) for name, raw in header.items()}
    need = max((e.offset + e.nbytes for e in table.values()), default=0)
    if need > size:
        raise OSError(
            f"{path.name}: truncated, or its header is wrong: {size} bytes, its tensors need {need}"
        )
    return table, {str(k): str(v) for k, v in metadata.items()}


class SampleFile:
    """One sample's file: what it holds, from its header (parsed once, here), and its
    tensors, each read by pread at the offsets that header gives.

    A file that is not whole safetensors is an OSError (a cache counts and skips those);
    one that is, but holds no sample fit to train, a SampleCacheError. No file handle is
    kept: a cache may hold 100K of these.
    """

    def __init__(self, path: Path, flat_width: int) -> None:
        """`flat_width`: D, to tell K of a flat [t, K*D] file."""
        self.path = path
        self.tensors, self.metadata = _tensor_table(path)
        names = set(self.tensors)
        if HIDDEN not in names or not names & {"token_ids", "input_ids"}:
            raise SampleCacheError(
                f"{path} is not a hidden-state sample: it has {sorted(names)}, not {HIDDEN} "
                "and token_ids"
            )
        self.ids_name = "token_ids" if "token_ids" in names else "input_ids"
        hidden = self.tensors[HIDDEN]
        self.dtype = hidden.dtype  # safetensors' name
        # [t, L, D] with token_ids; else flat [t, K*D] (its last layer apart), input_ids.
        self.stacked = len(hidden.shape) == 3
        self.has_verifier = VERIFIER in names
        self.has_loss_mask = LOSS_MASK in names
        if self.stacked:
            self.length, self.layers, self.width = hidden.shape
        elif len(hidden.shape) == 2 and flat_width and hidden.shape[1] % flat_width == 0:
            self.length, self.layers = hidden.shape[0], hidden.shape[1] // flat_width
            self.width = flat_width
        else:
            raise SampleCacheError(
                f"{path}: {HIDDEN} of shape {list(hidden.shape)} is neither [t, layers, D] "
                f"nor [t, K*D] with the target's D={flat_width}"
            )
        self._check_lengths()

    def _check_lengths(self) -> None:
        ids = self.tensors[self.ids_name].shape
        if ids[:1] != (self.length,):
            raise SampleCacheError(
                f"{self.path}: {ids[0] if ids else 0} token ids but hidden states for "
                f"{self.length} positions"
            )
        mask = self.tensors[LOSS_MASK].shape if self.has_loss_mask else (self.length,)
        if mask[:1] != (self.length,):
            raise SampleCacheError(
                f"{self.path}: {LOSS_MASK} has {mask[0] if mask else 0} entries, input_ids "
                f"{self.length}"
            )
        if self.has_verifier and self.tensors[VERIFIER].shape != (self.length, self.width):
            raise SampleCacheError(
                f"{self.path}: {VERIFIER} of shape {list(self.tensors[VERIFIER].shape)}, "
                f"not [{self.length}, {self.width}]"
            )

    def nbytes(self, *names: str) -> int:
        """Bytes of the named tensors in the file."""
        return sum(self.tensors[name].nbytes for name in names)

    def read(self, *names: str) -> list[Tensor]:
        """The named tensors in their shapes and dtypes: one open, one pread each, their
        bytes alone read and copied once (the tensors own their buffers)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:  # removed or made unreadable after its header was read
            raise SampleCacheError(
                f"hidden-state sample {self.path} is unreadable: {err}"
            ) from None
        try:
            return [self._pread(fd, name) for name in names]
        finally:
            os.close(fd)

    def _pread(self, fd: int, name: str) -> Tensor:
        entry = self.tensors.get(name)
        if entry is None:  # soft labels are decided by the first file; this one may lack them
            raise SampleCacheError(f"hidden-state sample {self.path} has no {name}")
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise SampleCacheError(f"{self.path}: {name} is {entry.dtype}, not a dtype read here")
        if entry.nbytes == 0:  # torch.frombuffer refuses an empty buffer
            return torch.zeros(entry.shape, dtype=dtype)
        buf = bytearray(entry.nbytes)  # writable: torch warns on a bytes object
        view, done = memoryview(buf), 0
        while done < entry.nbytes:  # Linux reads at most about 2 GiB per call
            got = os.preadv(fd, [view[done:]], entry.offset + done)
            if got == 0:
                raise SampleCacheError(
                    f"hidden-state sample {self.path} shrank after it was opened: {name} "
                    f"needs bytes up to {entry.offset + entry.nbytes}"
                )
            done += got
        return torch.frombuffer(buf, dtype=dtype).view(entry.shape)
