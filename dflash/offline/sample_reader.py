"""Training from per-sample hidden-state files: the reader that stands in for the target."""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from dflash.data.datasets import Batch, PackedDataset
from dflash.log import NOT_PRINTED, get_logger
from dflash.offline.sample_cache import SampleCache, SampleRows
from dflash.offline.sample_file import DTYPES, HIDDEN, VERIFIER, SampleFile
from dflash.target.model import TargetOutput

logger = get_logger("offline")


class SampleCacheReader:
    """The target stage of a run trained from sample files: batch i's features, built
    from the files of its rows' samples (each tensor pread alone: only this batch's
    bytes are read).

    Thread contract: `read` may be called from several threads; counters are locked.
    """

    def __init__(
        self,
        cache: SampleCache,
        dataset: PackedDataset,
        rows: SampleRows,
        norm: torch.nn.Module | None,
    ) -> None:
        self.cache, self.dataset, self.rows, self.norm = cache, dataset, rows, norm
        self.k = len(cache.layer_ids)
        first = next(iter(cache.samples.values()))  # open_sample_cache: all alike
        self.dtype, self.width = DTYPES[first.dtype], first.width
        self.bytes_read = 0  # of every tensor read: hidden states and verifier states
        self._lock = threading.Lock()

    def _fill(self, sample: SampleFile, hidden: Tensor, final: Tensor | None) -> int:
        """Copies one sample's features into hidden[t, K*D] (and final[t, D]) of its place
        in the row; -> the bytes read."""
        t, k = hidden.shape[0], self.k
        if sample.stacked:  # [t, L, D]: the last layer is the slice after the K
            (hs,) = sample.read(HIDDEN)
            hidden.view(t, k, -1).copy_(hs[:t, :k])
            if final is not None:
                final.copy_(hs[:t, k])
            return sample.nbytes(HIDDEN)
        names = (HIDDEN,) if final is None else (HIDDEN, VERIFIER)
        tensors = sample.read(*names)
        hidden.copy_(tensors[0][:t])
        if final is not None:
            final.copy_(tensors[1][:t])
        return sample.nbytes(*names)

    def read(self, batch: Batch) -> TargetOutput:
        rows = self.dataset.row_indices(batch.batch_id)
        b, t = batch.input_ids.shape
        dtype, d = self.dtype, self.width
        hidden = torch.zeros(b, t, self.k * d, dtype=dtype)
        soft = self.norm is not None and self.cache.has_last
        final = torch.zeros(b, t, d, dtype=dtype) if soft else None
        read = 0
        places = []
        for r, row in enumerate(rows):
            for index, start, length in self.rows.segments[int(row)]:
                span = slice(start, start + length)
                sample = self.cache.samples[index]
                read += self._fill(
                    sample, hidden[r, span], None if final is None else final[r, span]
                )
                places.append((r, span, index))
        # One check of the whole batch; only a batch with a bad sample looks for it.
        if not (torch.isfinite(hidden).all() and (final is None or torch.isfinite(final).all())):
            for r, span, index in places:
                bad = not torch.isfinite(hidden[r, span]).all() or (
                    final is not None and not torch.isfinite(final[r, span]).all()
                )
                if bad:
                    hidden[r, span] = 0
                    if final is not None:
                        final[r, span] = 0
                    batch.loss_mask[r, span] = False  # learned from: nothing
                    with self._lock:
                        self.cache.skipped.nonfinite += 1
                        skipped = self.cache.skipped.nonfinite
                    # For telemetry, tied to the batch's span: the summary counts them.
                    logger.warning(
                        "hidden cache: sample hs_%d (batch %d) has non-finite hidden states: "
                        "its positions are not learned from (%d such samples so far)",
                        index,
                        batch.batch_id,
                        skipped,
                        extra={**NOT_PRINTED, "dflash.batch_id": batch.batch_id},
                    )
        with self._lock:
            self.bytes_read += read
        if final is not None and self.norm is not None:
            with torch.no_grad():
                final = self.norm(final.to(next(self.norm.parameters()).device)).to(final.dtype)
        return TargetOutput(hidden=hidden, logits=None, final_hidden=final)
