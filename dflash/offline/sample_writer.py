"""`cache-hidden --format speculators`: the per-sample hidden-state files (speculators'
layout, dflash.offline.sample_cache reads them), their manifest of rows, and speculators'
Arrow dataset beside them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

from dflash.data.datasets import PackedDataset
from dflash.data.tokenizer import tokenizer_fingerprint
from dflash.files import replacing, write_json_atomic, write_text_atomic
from dflash.offline.sample_cache import MANIFEST, SAMPLES_DIR, Manifest
from dflash.offline.sample_file import SampleCacheError
from dflash.target.model import TargetModel

SAMPLES_JSONL = "samples.jsonl"  # write_sample_plan: the samples, for an engine to extract

Plan = dict[str, list[list[list[int]]]]  # "rows", "heldout_rows": the manifest's rows


def _plan(train: PackedDataset, heldout: PackedDataset) -> Plan:
    """The manifest's rows: per row, [sample index, start, length] of each document that
    has a position to learn (padding and pieces without one get no file); train rows
    first, then held-out ones, numbered in that order."""
    if train.doc_ids is None or train.positions is None:
        raise SampleCacheError(
            "cache-hidden --format speculators writes one file per document: use --packing docs"
        )
    plan: Plan = {"rows": [], "heldout_rows": []}
    index = 0
    for key, dataset in (("rows", train), ("heldout_rows", heldout)):
        if key == "heldout_rows" and dataset is train:
            continue
        assert dataset.doc_ids is not None
        for row in range(len(dataset)):
            segments = []
            for start, length in document_segments(dataset, row):
                segments.append([index, start, length])
                index += 1
            plan[key].append(segments)
    return plan


def document_segments(dataset: PackedDataset, row: int) -> list[tuple[int, int]]:
    """(start, length) of each document of `row` that has a position to learn: the
    samples an engine extracts (padding and pieces without one get no file)."""
    assert dataset.doc_ids is not None
    docs, mask = dataset.doc_ids[row], dataset.mask[row]
    found = []
    for doc in np.unique(docs):
        where = np.nonzero(docs == doc)[0]
        start, length = int(where[0]), len(where)
        if mask[start : start + length].any():
            found.append((start, length))
    return found


def _manifest(
    target: TargetModel, seq_len: int, layer_ids: list[int], with_last_layer: bool, plan: Plan
) -> Manifest:
    return {
        "format": "speculators",
        "target": target.spec,
        "layer_ids": list(layer_ids),
        "aux_hidden_state_layer_ids": [i + 1 for i in layer_ids],
        "last_layer": with_last_layer,
        "tokenizer": tokenizer_fingerprint(target.tokenizer),
        "seq_len": seq_len,
        "dtype": str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        "rows": plan["rows"],
        "heldout_rows": plan["heldout_rows"],
    }


@dataclass
class _ArrowColumns:
    """speculators' preprocessed dataset, one sample a row (its trainer reads input_ids,
    loss_mask and seq_len there)."""

    input_ids: list[list[int]] = field(default_factory=list)
    loss_mask: list[list[int]] = field(default_factory=list)
    seq_len: list[int] = field(default_factory=list)

    def add(self, ids: list[int], mask: list[int]) -> None:
        self.input_ids.append(ids)
        self.loss_mask.append(mask)
        self.seq_len.append(len(ids))

    def write(self, out: Path) -> None:
        """Saved to `out` when `datasets` is installed; the files stand on their own
        without."""
        try:
            from datasets import Dataset  # deferred: an optional dependency
        except ImportError:
            return
        columns = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "seq_len": self.seq_len,
        }
        # Its preprocessing saves the dataset in torch format; its trainer compares tensors.
        Dataset.from_dict(columns).with_format("torch").save_to_disk(str(out))


def write_sample_cache(
    target: TargetModel,
    train: PackedDataset,
    heldout: PackedDataset,
    output_dir: Path | str,
    *,
    layer_ids: list[int],
    with_last_layer: bool,
    batch_rows: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Every document of the train (and held-out) rows as one hs_{i} file, the features
    taken from the row's forward (document masks keep each document to itself, so a
    document's states are what it alone gives), and the manifest of rows. Written in
    speculators' layout; `datasets`, when installed, adds speculators' Arrow dataset."""
    plan = _plan(train, heldout)
    out = Path(output_dir)
    (out / SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
    last = target.num_layers - 1
    capture_ids = list(layer_ids) + ([last] if with_last_layer else [])
    arrow = _ArrowColumns()
    total = sum(len(rows) for rows in plan.values())
    done = 0
    for dataset, planned in ((train, plan["rows"]), (heldout, plan["heldout_rows"])):
        for begin in range(0, len(planned), batch_rows):
            rows = np.arange(begin, min(begin + batch_rows, len(planned)))
            stacked = _capture(target, dataset, rows, capture_ids)
            for r, row in enumerate(rows):
                for index, start, length in planned[row]:
                    piece = slice(start, start + length)
                    ids = torch.from_numpy(dataset.ids[row, piece].astype(np.int64))
                    mask = torch.from_numpy(dataset.mask[row, piece].copy())
                    _save_sample(out, index, ids, stacked[r, piece].contiguous(), mask)
                    arrow.add(ids.tolist(), mask.int().tolist())
            done += len(rows)
            if progress is not None:
                progress(done, total)
    manifest = _manifest(target, train.seq_len, layer_ids, with_last_layer, plan)
    write_json_atomic(out / MANIFEST, manifest)
    arrow.write(out)
    return out


def _capture(
    target: TargetModel, dataset: PackedDataset, rows: np.ndarray, capture_ids: list[int]
) -> Tensor:
    """The target's states of `rows` at `capture_ids`: [rows, t, len(capture_ids), D]."""
    assert dataset.doc_ids is not None  # _plan: docs packing
    ids = torch.from_numpy(dataset.ids[rows].astype(np.int64))
    docs = torch.from_numpy(dataset.doc_ids[rows].astype(np.int64))
    on = target.device
    out = target.capture(ids.to(on), capture_ids, with_logits=False, doc_ids=docs.to(on))
    shape = (len(rows), dataset.seq_len, len(capture_ids), target.hidden_size)
    return out.hidden.view(shape).cpu()


def _save_sample(out: Path, index: int, ids: Tensor, hidden: Tensor, mask: Tensor) -> None:
    tensors = {"token_ids": ids, "hidden_states": hidden, "loss_mask": mask}
    with replacing(out / SAMPLES_DIR / f"hs_{index}.safetensors") as tmp:
        save_file(tensors, str(tmp))


def write_sample_plan(
    target: TargetModel,
    train: PackedDataset,
    heldout: PackedDataset,
    output_dir: Path | str,
    *,
    layer_ids: list[int],
) -> Path:
    """What write_sample_cache writes, but the states: the manifest (the last layer
    included, as engines extract it) and every sample as one line of samples.jsonl,
    {"index", "token_ids", "loss_mask"}, for an engine to fill OUT/hidden_states with
    (tools/vllm/extract_hidden_states.py: vLLM's own forward). The target's decoder never
    runs. -> the path of samples.jsonl."""
    plan = _plan(train, heldout)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrow = _ArrowColumns()
    lines = []
    for dataset, planned in ((train, plan["rows"]), (heldout, plan["heldout_rows"])):
        for row, segments in enumerate(planned):
            for index, start, length in segments:
                ids = dataset.ids[row, start : start + length].astype(np.int64).tolist()
                mask = dataset.mask[row, start : start + length].astype(int).tolist()
                lines.append(json.dumps({"index": index, "token_ids": ids, "loss_mask": mask}))
                arrow.add(ids, mask)
    path = out / SAMPLES_JSONL
    write_text_atomic(path, "".join(line + "\n" for line in lines))
    manifest = _manifest(target, train.seq_len, layer_ids, True, plan)
    write_json_atomic(out / MANIFEST, manifest)
    arrow.write(out)
    return path
