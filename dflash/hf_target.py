"""Hugging Face causal LMs as targets: loading, geometry and stop tokens.

Imported only when a target spec is not `builtin:...`, so transformers stays optional.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.rope import RopeError, rope_from_config
from dflash.target import TargetError, TargetGeometry, TargetModel

__all__ = ["hf_geometry", "hf_stop_token_ids", "load_hf_target"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "org/name" or a legacy "name"


def _find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise TargetError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_hf_target(spec: str, device: torch.device | str, dtype: torch.dtype | None) -> TargetModel:
    path = Path(spec).expanduser()
    if not path.exists() and not _HUB_ID.match(spec):
        raise TargetError(f"target path does not exist: {spec}")
    if path.exists() and not (path / "config.json").is_file():
        raise TargetError(f"target {spec} is not a Hugging Face model directory (no config.json)")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise TargetError(
            "Hugging Face targets need transformers: pip install 'dflash-train[hf]'"
        ) from err
    source = str(path) if path.exists() else spec
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32)
    except (ValueError, KeyError) as err:
        raise TargetError(f"target {spec} is not a causal LM: {_first_line(err)}") from err
    except OSError as err:
        where = "" if path.exists() else " (no such local directory; tried the hub)"
        raise TargetError(f"cannot load target {spec}{where}: {_first_line(err)}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (ValueError, OSError, KeyError) as err:
        raise TargetError(
            f"cannot load the tokenizer of target {spec}: {_first_line(err)}"
        ) from err
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        raise TargetError(f"target {spec} has no linear LM head")
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    layers = _find_decoder_layers(model, cfg.num_hidden_layers)
    target = TargetModel(
        model,
        layers,
        spec=spec,
        tokenizer=tokenizer,
        geometry=hf_geometry(cfg),
        stop_token_ids=hf_stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
    )
    return target.to(device)


def hf_geometry(cfg: Any) -> TargetGeometry:
    """A drafter's geometry from a transformers text config (4.x or 5.x rope layout)."""
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    try:
        rope = rope_from_config(cfg)
    except RopeError as err:
        raise TargetError(f"target rope parameters: {err}") from err
    return TargetGeometry(
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate_size=int(cfg.intermediate_size),
        rope=rope,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", None) or 2048),
    )


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def hf_stop_token_ids(tokenizer: Any, generation_config: Any) -> tuple[int, ...]:
    """EOS of the tokenizer plus the generation config's EOS ids (chat models list several)."""
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None))
    ids += _as_ids(getattr(generation_config, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))
