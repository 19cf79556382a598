"""Per-sample hidden-state files in the layout vllm-project/speculators reads and writes.

speculators extracts a target's hidden states with vLLM (the target served with tensor
and pipeline parallelism) into one safetensors file per sample:

  DIR/hidden_states/hs_{i}.safetensors
      token_ids      int64[t]       the sample's tokens
      hidden_states  [t, L, D]      the auxiliary layers' outputs, then (when vLLM ran
                                    with the last layer included) the last decoder
                                    layer's output before the final norm
      loss_mask      [t]            (ours, and older speculators files) where the loss counts
  DIR/                              speculators' preprocessed dataset (Arrow, `datasets`):
                                    input_ids, loss_mask, seq_len per sample

Older speculators files hold `input_ids`, `hidden_states` [t, K*D], `loss_mask` and
`verifier_last_hidden_states` [t, D] instead; both are read. Layer numbers: speculators'
`aux_hidden_state_layer_ids` count the embedding output as 0 (transformers'
`hidden_states` tuple), so its id j is the output of our decoder layer j - 1, the one
`--target-layers` names (its DFlash converter writes target_layer_ids + 1 the same way).

`cache-hidden --format speculators` writes this layout from this project's target runner
plus `dflash_samples.json`: which target layers the files hold, and which samples make
each training row, so the rows trained from the files are the rows the online run packs.
Without that manifest (files from speculators) samples are split by name into training
and held-out ones and packed whole into rows of --seq-len, each a document of its own.

Here: the directory, checked once at start (each file's header parsed once, in
sample_file.SampleFile), and its rows; sample_reader reads batches while training,
sample_writer writes the layout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch

from dflash.data.corpus import is_heldout
from dflash.data.datasets import PackedDataset
from dflash.data.packing import PackReport, RowBuilder
from dflash.data.sources import DataReport
from dflash.data.tokenizer import tokenizer_fingerprint
from dflash.log import Log, say
from dflash.offline.hidden_cache import INDEX_NAME
from dflash.offline.sample_file import LOSS_MASK, SampleCacheError, SampleFile, dtype_name
from dflash.target.model import TargetModel

SAMPLES_DIR = "hidden_states"
MANIFEST = "dflash_samples.json"
_FILE = re.compile(r"^hs_(\d+)\.safetensors$")


# --------------------------------------------------------------------------- formats


def sample_dir(directory: Path) -> Path:
    """Where the hs_{i} files are: DIR/hidden_states (speculators' layout) or DIR."""
    nested = directory / SAMPLES_DIR
    return nested if nested.is_dir() else directory


def _sample_paths(directory: Path) -> Iterator[tuple[int, Path]]:
    where = sample_dir(directory)
    if where.is_dir():
        for path in where.iterdir():
            match = _FILE.match(path.name)
            if match:
                yield int(match.group(1)), path


def sample_files(directory: Path) -> dict[int, Path]:
    return dict(sorted(_sample_paths(directory)))


def cache_format(directory: Path | str) -> str:
    """`dflash` (index.json: batches of this project's cache) or `speculators` (hs_{i}
    sample files); a directory with both or neither is one line."""
    path = Path(directory)
    # The first sample file settles it: a cache may hold 100K of them.
    batches = (path / INDEX_NAME).is_file()
    samples = next(_sample_paths(path), None) is not None
    if batches and samples:
        raise SampleCacheError(
            f"--hidden-cache {path} holds both a batch cache ({INDEX_NAME}) and per-sample "
            "hs_*.safetensors files: point it at one of them"
        )
    if not (batches or samples):
        raise SampleCacheError(
            f"--hidden-cache {path}: neither a hidden-state cache ({INDEX_NAME}, written by "
            "cache-hidden) nor per-sample hs_*.safetensors files (speculators' layout)"
        )
    return "dflash" if batches else "speculators"


def _arrow_loss_masks(directory: Path) -> dict[int, np.ndarray] | None:
    """Loss masks of speculators' preprocessed dataset beside the files, by sample index."""
    arrows = sorted(directory.glob("data-*.arrow"))
    if not arrows:
        return None
    try:
        import pyarrow as pa  # deferred: only speculators' own datasets need it
    except ImportError:
        raise SampleCacheError(
            f"--hidden-cache {directory}: the loss masks are in speculators' Arrow dataset, "
            "which needs pyarrow (pip install pyarrow)"
        ) from None
    masks: dict[int, np.ndarray] = {}
    for arrow in arrows:
        with pa.memory_map(str(arrow)) as source:
            table = pa.ipc.open_stream(source).read_all()
        for row in table.column("loss_mask").to_pylist():
            masks[len(masks)] = np.asarray(row, dtype=bool)
    return masks


# --------------------------------------------------------------------------- opening


class Manifest(TypedDict):
    """dflash_samples.json, as cache-hidden --format speculators writes it."""

    format: str
    target: str
    layer_ids: list[int]  # ours; speculators' aux ids are these + 1
    aux_hidden_state_layer_ids: list[int]
    last_layer: bool
    tokenizer: str
    seq_len: int
    dtype: str
    # Per training row, then per held-out row: [sample index, start, length] of each of
    # its samples.
    rows: list[list[list[int]]]
    heldout_rows: list[list[list[int]]]


@dataclass
class SkipCounts:
    missing: int = 0  # no file for a sample the manifest names
    unreadable: int = 0  # truncated or not a safetensors file
    nonfinite: int = 0  # found while training: the sample's loss positions are dropped
    truncated: int = 0  # longer than --seq-len: cut


@dataclass
class SampleCache:
    """The sample files of one directory, checked against a run's target and layers."""

    directory: Path
    files: dict[int, Path]  # every hs_{i} found
    samples: dict[int, SampleFile]  # the readable ones, each header parsed once
    layer_ids: list[int]
    has_last: bool
    manifest: Manifest | None
    skipped: SkipCounts = field(default_factory=SkipCounts)
    _arrow_masks: dict[int, np.ndarray] | None = None
    _arrow_read: bool = False

    def arrow_mask(self, index: int) -> np.ndarray | None:
        """The loss mask speculators' Arrow dataset beside the files holds for `index`."""
        if not self._arrow_read:
            self._arrow_masks, self._arrow_read = _arrow_loss_masks(self.directory), True
        return None if self._arrow_masks is None else self._arrow_masks.get(index)

    def describe(self) -> str:
        kind = "written by cache-hidden" if self.manifest else "speculators' layout"
        aux = [i + 1 for i in self.layer_ids]
        return (
            f"hidden cache: {len(self.samples):,} samples in {sample_dir(self.directory)} "
            f"({kind}): target layers {self.layer_ids} (speculators' aux ids {aux})"
            + (", and the last layer for soft labels" if self.has_last else "")
            + "; the target's decoder layers never run while training"
        )


def open_sample_cache(
    directory: Path | str,
    *,
    target: TargetModel,
    layer_ids: list[int] | None,
    soft_labels: bool,
    strict: bool = False,
) -> SampleCache:
    """Headers of every file, checked: one width, dtype and layer count, the target's
    hidden size and dtype, the run's layers (`layer_ids`; None: --target-layers unset),
    soft labels only with the last layer present. Unreadable files are counted and
    left out (`strict`: one line instead)."""
    path = Path(directory)
    files = sample_files(path)
    manifest = _read_manifest(path, target)
    skipped = SkipCounts()
    samples = _open_files(path, files, target.hidden_size, strict, skipped)
    first = _check_alike(path, samples, target)
    ids, has_last = _layers(path, first, manifest, layer_ids, target.num_layers)
    if soft_labels and not has_last:
        raise SampleCacheError(
            f"--use-soft-labels: the samples in {path} have no last-layer states (speculators: "
            "vLLM's --include-last-layer; cache-hidden --format speculators always writes it)"
        )
    if manifest is not None:
        named = {i for row in manifest["rows"] + manifest.get("heldout_rows", []) for i, *_ in row}
        lost = named - set(samples)
        if lost and strict:
            raise SampleCacheError(
                f"--hidden-cache {path}: {len(lost)} samples named in {MANIFEST} are missing or "
                f"unreadable (e.g. hs_{min(lost)}.safetensors)"
            )
        skipped.missing = len(lost - set(files))
    return SampleCache(path, files, samples, ids, has_last, manifest, skipped)


def _read_manifest(path: Path, target: TargetModel) -> Manifest | None:
    """cache-hidden's manifest beside the files (None: files from speculators), refused
    when it was written with another tokenizer."""
    if not (path / MANIFEST).is_file():
        return None
    try:
        manifest: Manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise SampleCacheError(f"{path / MANIFEST} is unreadable: {err}") from None
    ours = tokenizer_fingerprint(target.tokenizer)
    if manifest.get("tokenizer") != ours:
        raise SampleCacheError(
            f"--hidden-cache {path} was written with tokenizer {manifest.get('tokenizer')!r}, "
            f"target {target.spec} has {ours!r}"
        )
    return manifest


def _open_files(
    path: Path, files: dict[int, Path], width: int, strict: bool, skipped: SkipCounts
) -> dict[int, SampleFile]:
    """Each file's header, parsed once; one that is not whole is counted and left out
    (`strict`: one line naming it)."""
    samples: dict[int, SampleFile] = {}
    for index, file in files.items():
        try:
            samples[index] = SampleFile(file, width)
        except OSError as err:
            if strict:
                raise SampleCacheError(
                    f"hidden-state sample {file} is unreadable (truncated?): {err}"
                ) from None
            skipped.unreadable += 1
    if not samples:
        raise SampleCacheError(f"--hidden-cache {path}: no readable hs_*.safetensors file")
    return samples


def _check_alike(path: Path, samples: dict[int, SampleFile], target: TargetModel) -> SampleFile:
    """The first sample, once every other holds as many layers of its width and dtype, and
    those are the target's hidden size and dtype."""
    first = next(iter(samples.values()))
    kind = (first.layers, first.width, first.stacked, first.dtype)
    for sample in samples.values():
        if (sample.layers, sample.width, sample.stacked, sample.dtype) != kind:
            raise SampleCacheError(
                f"hidden-state samples of different shapes: {first.path.name} holds "
                f"{first.layers} layers of width {first.width} ({first.dtype}), "
                f"{sample.path.name} {sample.layers} of {sample.width} ({sample.dtype})"
            )
    if first.width != target.hidden_size:
        raise SampleCacheError(
            f"--hidden-cache {path}: hidden width {first.width}, target {target.spec} has "
            f"hidden size {target.hidden_size}"
        )
    want_dtype = str(target.embed_tokens.weight.dtype).removeprefix("torch.")
    if dtype_name(first.dtype) != want_dtype:
        raise SampleCacheError(
            f"--hidden-cache {path}: hidden states in {dtype_name(first.dtype)}, target "
            f"{target.spec} runs in {want_dtype} (load it with that dtype)"
        )
    return first


def _layers(
    path: Path,
    header: SampleFile,
    manifest: Manifest | None,
    wanted: list[int] | None,
    num_layers: int,
) -> tuple[list[int], bool]:
    """Our layer ids of the files' auxiliary layers, and whether the last layer follows."""
    if manifest is not None:
        ids, has_last = [int(i) for i in manifest["layer_ids"]], bool(manifest["last_layer"])
        named = f"{MANIFEST} names target layers {ids}" + (" and the last" if has_last else "")
    elif wanted is None:
        raise SampleCacheError(
            f"--hidden-cache {path}: speculators' files do not record their layers: pass "
            "--target-layers (speculators' aux_hidden_state_layer_ids minus 1)"
        )
    else:
        ids = list(wanted)
        # speculators' trainer always takes a [t, L, D] file's last slice for the
        # verifier's last layer (vLLM runs with it included): so do we.
        has_last = header.stacked or header.has_verifier
        named = f"--target-layers names {len(ids)} ({ids})"
    # Files unlike their manifest (replaced or cut) would otherwise fail mid-run in the reader.
    count = header.layers - 1 if header.stacked and has_last else header.layers
    no_last = has_last and not header.stacked and not header.has_verifier
    if count != len(ids) or no_last:
        then = " (then the last layer)" if header.stacked and has_last else ""
        if no_last:
            then = " and no last layer"
        raise SampleCacheError(
            f"--hidden-cache {path}: the files hold {count} auxiliary layers{then}, {named}"
        )
    if wanted is not None and list(wanted) != ids:
        raise SampleCacheError(
            f"--hidden-cache {path} holds target layers {ids}, --target-layers names {list(wanted)}"
        )
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise SampleCacheError(
            f"--hidden-cache {path}: layer {bad[0]} of {ids} is not a layer of the target "
            f"({num_layers} layers)"
        )
    return ids, has_last


# --------------------------------------------------------------------------- rows


@dataclass
class SampleRows:
    """Packed rows and, per row, its samples: (sample index, start in the row, length)."""

    ids: np.ndarray
    mask: np.ndarray
    doc_ids: np.ndarray
    positions: np.ndarray
    segments: list[list[tuple[int, int, int]]]


def _pack(
    samples: list[tuple[int, np.ndarray, np.ndarray]],
    seq_len: int,
    pad_id: int,
    skipped: SkipCounts,
) -> SampleRows:
    """Samples placed whole (cut to seq_len) into rows, each a document of its own."""
    rows: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for index, ids, mask in samples:
        if len(ids) > seq_len:
            ids, mask = ids[:seq_len], mask[:seq_len]
            skipped.truncated += 1
        if used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((index, ids, mask))
        used += len(ids)
    return _assemble([r for r in rows if r], seq_len, pad_id)


def _assemble(
    rows: list[list[tuple[int, np.ndarray, np.ndarray]]], seq_len: int, pad_id: int
) -> SampleRows:
    """Rows of the packer's layout (dflash.data.packing.RowBuilder: each sample a document
    of its own, the padding one more), and where each sample lies in its row."""
    builder = RowBuilder(seq_len, pad_id)
    segments: list[list[tuple[int, int, int]]] = []
    for row in rows:
        segments.append([])
        for index, sample_ids, sample_mask in row:
            segments[-1].append((index, builder.used, len(sample_ids)))
            builder.add(sample_ids, sample_mask)
        builder.flush()  # a no-op when the last sample filled the row
    ids, mask, doc, pos = (np.stack(a) for a in zip(*builder.rows, strict=True))
    return SampleRows(ids, mask, doc, pos, segments)


def _read_sample(cache: SampleCache, index: int) -> tuple[np.ndarray, np.ndarray]:
    """A sample's token ids and loss mask: the file's, else speculators' Arrow dataset's."""
    sample = cache.samples[index]
    if sample.has_loss_mask:
        ids, mask = sample.read(sample.ids_name, LOSS_MASK)
        return ids.to(torch.int32).numpy(), (mask != 0).numpy()
    (ids,) = sample.read(sample.ids_name)
    arrow = cache.arrow_mask(index)
    if arrow is None:
        raise SampleCacheError(
            f"{sample.path} has no loss_mask, and no speculators dataset beside "
            f"{cache.directory} holds it"
        )
    if len(arrow) < len(ids):
        raise SampleCacheError(
            f"sample {index}: loss_mask has {len(arrow)} entries, input_ids {len(ids)}"
        )
    return ids.to(torch.int32).numpy(), arrow[: len(ids)]


def sample_datasets(
    cache: SampleCache,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    heldout_fraction: float,
    pad_id: int,
    log: Log = say,
) -> tuple[PackedDataset, PackedDataset, SampleRows]:
    """(train, held-out) rows of the samples, and the train rows' segments: the rows the
    manifest records, else the samples split by name and packed whole."""
    if cache.manifest is not None:
        train_rows, held_rows = _manifest_rows(cache, cache.manifest, seq_len, pad_id)
    else:
        train_rows, held_rows = _named_rows(cache, seq_len, heldout_fraction, pad_id)
    if train_rows is None:
        raise SampleCacheError(f"--hidden-cache {cache.directory}: no training sample is readable")
    report = DataReport()
    report.pack = PackReport(documents=sum(len(s) for s in train_rows.segments))
    if cache.skipped.truncated:
        log(
            f"hidden cache: {cache.skipped.truncated} samples longer than --seq-len {seq_len} "
            "were cut to it"
        )
    lost = cache.skipped.missing + cache.skipped.unreadable
    if lost:
        log(
            f"hidden cache: {lost} sample files missing or unreadable, left out "
            "(--strict-cache stops instead)"
        )

    def dataset(rows: SampleRows) -> PackedDataset:
        return PackedDataset(
            rows.ids,
            rows.mask,
            batch_size,
            seed,
            doc_ids=rows.doc_ids,
            positions=rows.positions,
            report=report,
        )

    train = dataset(train_rows)
    return train, dataset(train_rows if held_rows is None else held_rows), train_rows


def _manifest_rows(
    cache: SampleCache, manifest: Manifest, seq_len: int, pad_id: int
) -> tuple[SampleRows | None, SampleRows | None]:
    """(train, held-out) rows as the manifest records them, of the samples still readable;
    None where none is."""
    if int(manifest["seq_len"]) != seq_len:
        raise SampleCacheError(
            f"--hidden-cache {cache.directory} was packed for --seq-len {manifest['seq_len']}, "
            f"this run {seq_len}"
        )
    built: list[SampleRows | None] = []
    for key in ("rows", "heldout_rows"):
        rows = [
            [(index, *_read_sample(cache, index)) for index, *_ in row if index in cache.samples]
            for row in manifest.get(key, [])
        ]
        kept = [row for row in rows if row]
        built.append(_assemble(kept, seq_len, pad_id) if kept else None)
    return built[0], built[1]


def _named_rows(
    cache: SampleCache, seq_len: int, heldout_fraction: float, pad_id: int
) -> tuple[SampleRows, SampleRows | None]:
    """Files without a manifest: split into (train, held-out) by name, packed whole; all
    train where the split leaves none to train."""
    held = {i for i, s in cache.samples.items() if is_heldout(s.path.name, heldout_fraction)}
    train_ids = [i for i in cache.samples if i not in held]
    held_ids = [i for i in cache.samples if i in held]
    if not train_ids:
        train_ids, held_ids = held_ids, []

    def pack(indices: list[int]) -> SampleRows:
        samples = [(i, *_read_sample(cache, i)) for i in indices]
        return _pack(samples, seq_len, pad_id, cache.skipped)

    return pack(train_ids), (pack(held_ids) if held_ids else None)
