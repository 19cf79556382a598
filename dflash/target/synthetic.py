"""Qwen3-shaped Hugging Face targets with random weights, for benchmarks and checks.

Nothing is downloaded: the model is built from a `transformers.Qwen3Config` on the
requested device and dtype. The weights are random, so the features carry no
meaning; shapes, memory and speed are those of the real model. Without a tokenizer,
drafters of these targets name their mask token explicitly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dflash.nn.rope import RopeSpec
from dflash.target.geometry import TargetGeometry, geometry_from_hf_config
from dflash.target.hf import hf_stop_token_ids
from dflash.target.model import TargetModel

if TYPE_CHECKING:
    from transformers import Qwen3Config

QWEN3_8B = TargetGeometry(
    hidden_size=4096,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=12_288,
    vocab_size=151_936,
    rope=RopeSpec(1_000_000.0),
    max_position_embeddings=40_960,
)
QWEN3_8B_MASK_TOKEN_ID = 151_669  # first row past the Qwen3 tokenizer's vocabulary
# The 32,768-row target of the memory benchmark: tiny layers, a real-sized LM head share.
TINY_QWEN3 = TargetGeometry(
    hidden_size=128,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=352,
    vocab_size=32_768,
    rope=RopeSpec(1_000_000.0),
    max_position_embeddings=4096,
)

# Hub ids whose geometry `--dry-run` knows without fetching their config.json.
KNOWN_SHAPES = {"Qwen/Qwen3-8B": QWEN3_8B}


def qwen3_config(geometry: TargetGeometry, dtype: torch.dtype = torch.float32) -> Qwen3Config:
    """The `transformers.Qwen3Config` of a geometry (untied embedding and LM head)."""
    from transformers import Qwen3Config  # deferred: transformers is an optional dependency

    return Qwen3Config(
        vocab_size=geometry.vocab_size,
        hidden_size=geometry.hidden_size,
        intermediate_size=geometry.intermediate_size,
        num_hidden_layers=geometry.num_layers,
        num_attention_heads=geometry.num_heads,
        num_key_value_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        rope_theta=geometry.rope.theta,
        rms_norm_eps=geometry.rms_norm_eps,
        max_position_embeddings=geometry.max_position_embeddings,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )


def random_qwen3_target(
    geometry: TargetGeometry = QWEN3_8B,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> TargetModel:
    """A frozen TargetModel around a randomly initialized Qwen3ForCausalLM."""
    from transformers import Qwen3ForCausalLM  # deferred: an optional dependency

    config = qwen3_config(geometry, dtype)
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
        spec=f"random:qwen3-{geometry.hidden_size}x{geometry.num_layers}",
        tokenizer=None,
        geometry=geometry_from_hf_config(config),
        stop_token_ids=hf_stop_token_ids(None, model.generation_config),
    )
