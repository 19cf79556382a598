"""Qwen3-shaped Hugging Face targets with random weights, for benchmarks and checks.

Nothing is downloaded: the model is built from a `transformers.Qwen3Config` on the
requested device and dtype. The weights are random, so the features carry no
meaning; shapes, memory and speed are those of the real model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from dflash.estimate import Geometry
from dflash.hf_target import hf_geometry
from dflash.target import TargetModel


@dataclass(frozen=True)
class Qwen3Shape:
    """Qwen3-8B's geometry by default."""

    vocab_size: int = 151_936
    hidden_size: int = 4096
    intermediate_size: int = 12_288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40_960
    mask_token_id: int = 151_669  # first row past the Qwen3 tokenizer's vocabulary

    def scaled(self, **changes: int | float) -> Qwen3Shape:
        return replace(self, **changes)


QWEN3_8B = Qwen3Shape()
# The 32,768-row target of the memory benchmark: tiny layers, a real-sized LM head share.
TINY_QWEN3 = Qwen3Shape(
    vocab_size=32_768, hidden_size=128, intermediate_size=352, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
    mask_token_id=32_767,
)  # fmt: skip


# Hub ids whose geometry `--dry-run` knows without fetching their config.json.
KNOWN_SHAPES = {"Qwen/Qwen3-8B": QWEN3_8B}


def shape_geometry(shape: Qwen3Shape) -> Geometry:
    """The estimator's Geometry of a Qwen3 shape."""
    return Geometry(
        shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers,
        shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim, shape.vocab_size,
    )  # fmt: skip


def random_qwen3_target(
    shape: Qwen3Shape = QWEN3_8B,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> TargetModel:
    """A frozen TargetModel around a randomly initialized Qwen3ForCausalLM."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = asdict(shape)
    fields.pop("mask_token_id")  # no tokenizer: drafters take it as an explicit id
    config = Qwen3Config(**fields, tie_word_embeddings=False, torch_dtype=dtype)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialize in the final dtype: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return TargetModel(
        model,
        model.model.layers,
        spec=f"random:qwen3-{shape.hidden_size}x{shape.num_hidden_layers}",
        tokenizer=None,
        geometry=hf_geometry(config),
    )
