"""A target's shape: the one type that loading, the drafter, `--dry-run` and the
estimate read, and the one reader of Hugging Face configs that fills it.

A drafter copies the attention and norm geometry from its target (heads, head_dim, KV
heads, rotary parameters, norm eps); the estimate counts parameters and FLOPs from the
same fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash.errors import DFlashError
from dflash.nn.rope import RopeError, RopeSpec, rope_from_config


class TargetError(DFlashError):
    """A target that cannot be used (bad spec or config, not a causal LM, bad layer ids)."""


@dataclass(frozen=True)
class TargetGeometry:
    """Decoder geometry of a target (and, by default, of its drafter's layers)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding and the LM head
    rope: RopeSpec = field(default_factory=RopeSpec)
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 2048

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, SwiGLU, norms)."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * d * self.intermediate_size + 2 * d + 2 * hd

    def params(self) -> int:
        """Parameters of the whole target, untied embedding and LM head included."""
        return self.num_layers * self.layer_params() + 2 * self.vocab_size * self.hidden_size


def text_config(config: object) -> object:
    """The language model's part of a config (multimodal configs nest it)."""
    if isinstance(config, Mapping):
        return config.get("text_config") or config
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def geometry_from_hf_config(config: object) -> TargetGeometry:
    """The geometry of a transformers config object or a config.json mapping (4.x or 5.x
    rotary layout); TargetError naming the key when one is missing or unusable."""
    cfg = text_config(config)

    def get(key: str, default: object = None) -> Any:  # Any: a config's value, any type
        value = cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)
        return default if value is None else value

    def need(key: str) -> int:
        value = get(key)
        if value is None:
            message = f"target config has no {key!r}"
            if kind := get("model_type"):
                unfit = "is not a Llama/Qwen-style decoder a DFlash drafter can follow"
                message += f": a {kind!r} model {unfit}"
            raise TargetError(message)
        return int(value)

    heads, hidden = need("num_attention_heads"), need("hidden_size")
    try:
        rope = rope_from_config(cfg)
    except RopeError as err:
        raise TargetError(f"target rope parameters: {err}") from err
    return TargetGeometry(
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or hidden // heads),
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        rope=rope,
        rms_norm_eps=float(get("rms_norm_eps") or 1e-6),
        attention_bias=bool(get("attention_bias", False)),
        max_position_embeddings=int(get("max_position_embeddings") or 2048),
    )
