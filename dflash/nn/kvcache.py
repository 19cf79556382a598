"""A minimal per-layer key/value cache for the built-in target and the drafter.

Speculative decoding appends a whole block and then keeps only its accepted
prefix, so the one operation beyond append is `crop(length)`. Hugging Face targets
use their own `DynamicCache`; `crop_hf_cache` hides the API change of its crop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import DynamicCache


class KVCache:
    """keys/values per layer, each [B, Hkv, L, Hd]; all layers hold the same L."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def seq_len(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def layer_len(self, layer_idx: int) -> int:
        """Positions held by one layer (0 before its first update)."""
        return self.keys[layer_idx].shape[2] if layer_idx < len(self.keys) else 0

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k/v[B, Hkv, L_new, Hd] to layer `layer_idx`; -> the layer's full k, v."""
        if layer_idx == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]

    def crop(self, length: int) -> None:
        """Keep the first `length` positions of every layer."""
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


def crop_hf_cache(cache: DynamicCache, length: int) -> None:
    """Crop a transformers Cache to `length` positions (4.x takes the length, 5.x the
    negative number of positions to drop)."""
    import transformers

    drop = cache.get_seq_length() - length
    if drop <= 0:
        return
    if int(transformers.__version__.split(".")[0]) >= 5:
        cache.crop(-drop)
    else:
        cache.crop(length)
