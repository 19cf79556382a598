"""The weights of a target's decoder layers under one set of names, for a drafter that
starts as the target's last layers (`--drafter-init target`, dflash.drafter.init).

The names are the Llama/Qwen ones the drafter's layers use (`self_attn.q_proj.weight`,
..., `mlp.down_proj.weight`, `input_layernorm.weight`, `post_attention_layernorm.weight`,
and `self_attn.q_norm/k_norm.weight` where the target has them): a Hugging Face target's
as they are, the built-in tiny target's renamed and its fused qkv projection split. A
head-only target (its decoder on the meta device) is read from its safetensors files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from dflash.target.geometry import TargetError
from dflash.target.hf import weight_files
from dflash.target.model import TargetModel

_TINY_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
}


def _module_prefix(model: nn.Module, module: nn.Module) -> str:
    for name, found in model.named_modules():
        if found is module:
            return name
    raise TargetError("the target's decoder layer is not among its modules")


def _from_files(target: TargetModel, module: nn.Module) -> dict[str, Tensor]:
    files = weight_files(Path(target.spec).expanduser())
    if files is None:
        raise TargetError(f"target {target.spec} has no safetensors weights to read layers from")
    prefix = _module_prefix(target.model, module)
    found = {}
    for name in module.state_dict():
        key = f"{prefix}.{name}"
        if key not in files:
            raise TargetError(f"target {target.spec}: its weights have no {key!r}")
        with safe_open(str(files[key]), framework="pt") as f:
            found[name] = f.get_tensor(key)
    return found


def _renamed(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tiny target's names as the drafter's (its qkv projection holds q, k, v rows)."""
    out = {}
    for name, tensor in weights.items():
        if name == "attn.qkv_proj.weight":
            for part, rows in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                out[f"self_attn.{part}_proj.weight"] = rows
        else:
            out[_TINY_NAMES.get(name, name)] = tensor
    return out


def decoder_layer_weights(target: TargetModel, index: int) -> dict[str, Tensor]:
    """Layer `index` (0-based) of the target: name -> float32 copy on the CPU."""
    if not 0 <= index < target.num_layers:
        raise TargetError(f"target {target.spec} has no layer {index} ({target.num_layers} layers)")
    module = target.decoder_layers[index]
    if target.head_only:
        weights = _from_files(target, module)
    else:
        weights = {k: v.detach() for k, v in module.state_dict().items()}
    return {k: v.to("cpu", torch.float32).clone() for k, v in _renamed(weights).items()}


def final_norm_weight(target: TargetModel) -> Tensor:
    """The weight of the target's last norm, the one its LM head reads after."""
    weight = getattr(target.final_norm(), "weight", None)
    if not isinstance(weight, Tensor) or weight.is_meta:
        raise TargetError(f"target {target.spec}: cannot find its final norm's weight")
    return weight.detach().to("cpu", torch.float32).clone()
