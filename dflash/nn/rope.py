"""Rotary position parameters: read from a target's config, written into a drafter's.

A drafter must rotate its queries and keys exactly as the target does (serving
engines build the drafter's rotary embedding from its config.json), so the base
theta and any scaling are the target's. Transformers 5 keeps them in
`rope_parameters` (`rope_type`, `rope_theta`, scaling keys); 4.x in `rope_theta`
and `rope_scaling`. `RopeSpec` holds both views.

The default, linear and llama3 frequency rules are computed here; other types
(yarn, longrope, ...) are delegated to the installed transformers, which defines them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dflash.errors import DFlashError

# Any: a value of a config's rope dict (a float, an int, a str), read as its key needs it.
RopeDict = dict[str, Any]


class RopeError(DFlashError):
    """Rotary parameters this project cannot reproduce; the message names the value."""


# Types whose frequencies change with the running sequence length: a drafter at
# arbitrary positions cannot follow them exactly.
_DYNAMIC_TYPES = ("dynamic",)


@dataclass(frozen=True)
class RopeSpec:
    """theta, the rope type and its scaling keys (factor, low_freq_factor, ...)."""

    theta: float = 10000.0
    rope_type: str = "default"
    scaling: RopeDict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise RopeError(f"rope theta {self.theta} must be > 0")
        if self.rope_type in _DYNAMIC_TYPES:
            raise RopeError(
                f"rope type {self.rope_type!r} depends on the sequence length; "
                "train the drafter for a target with static rope parameters"
            )
        if float(self.scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise RopeError(
                f"partial_rotary_factor {self.scaling['partial_rotary_factor']} is not supported"
            )

    def rope_scaling(self) -> RopeDict | None:
        """The 4.x `rope_scaling` dict (None for plain rope)."""
        if self.rope_type == "default":
            return None
        return {"rope_type": self.rope_type, **self.scaling}

    def rope_parameters(self) -> RopeDict:
        """The transformers 5 `rope_parameters` dict."""
        return {"rope_type": self.rope_type, "rope_theta": self.theta, **self.scaling}

    def to_dict(self) -> RopeDict:
        return {"theta": self.theta, "rope_type": self.rope_type, "scaling": dict(self.scaling)}

    @classmethod
    def from_dict(cls, data: RopeDict) -> RopeSpec:
        return cls(float(data["theta"]), str(data["rope_type"]), dict(data.get("scaling", {})))


def _split_rope_dict(params: RopeDict, theta: float | None) -> RopeSpec:
    params = dict(params)
    rope_type = str(params.pop("rope_type", params.pop("type", "default")) or "default")
    base = params.pop("rope_theta", None)
    base = theta if base is None else base
    return RopeSpec(float(base if base is not None else 10000.0), rope_type, params)


def rope_from_config(config: object) -> RopeSpec:
    """RopeSpec of a Hugging Face config object or config.json dict (4.x or 5.x layout)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    theta = get("rope_theta", None)
    params = get("rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
            raise RopeError(f"per-layer rope parameters are not supported: {sorted(params)}")
        return _split_rope_dict(params, theta)
    scaling = get("rope_scaling", None)
    if isinstance(scaling, dict) and scaling:
        return _split_rope_dict(scaling, theta)
    return RopeSpec(float(theta) if theta is not None else 10000.0)


def _default_inv_freq(theta: float, head_dim: int) -> Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)  # [Hd/2]


def _llama3_inv_freq(inv_freq: Tensor, scaling: RopeDict) -> Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    # Position of each wavelength between the "keep" (ramp 1) and "slow down" (ramp 0) bands.
    ramp = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - ramp) * inv_freq / factor + ramp * inv_freq


def _delegated(spec: RopeSpec, head_dim: int, max_positions: int) -> tuple[Tensor, float]:
    try:
        import transformers
        from transformers import PretrainedConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError as err:
        raise RopeError(f"rope type {spec.rope_type!r} needs transformers installed") from err
    if spec.rope_type not in ROPE_INIT_FUNCTIONS:
        raise RopeError(f"unknown rope type {spec.rope_type!r}")
    cfg = PretrainedConfig()
    cfg.head_dim, cfg.hidden_size, cfg.num_attention_heads = head_dim, head_dim, 1
    cfg.max_position_embeddings = max_positions
    if int(transformers.__version__.split(".")[0]) >= 5:
        cfg.rope_parameters = spec.rope_parameters()
    else:
        cfg.rope_theta, cfg.rope_scaling = spec.theta, spec.rope_scaling()
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, None)
    return inv_freq.float(), float(attention_scaling)


def rope_frequencies(spec: RopeSpec, head_dim: int, max_positions: int) -> tuple[Tensor, float]:
    """-> inv_freq float32[Hd/2], attention scaling (the factor on cos/sin; 1 unless yarn-like)."""
    if head_dim % 2:
        raise RopeError(f"head_dim {head_dim} must be even for rotary embeddings")
    if spec.rope_type == "default":
        return _default_inv_freq(spec.theta, head_dim), 1.0
    if spec.rope_type == "linear":
        return _default_inv_freq(spec.theta, head_dim) / float(spec.scaling["factor"]), 1.0
    if spec.rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(spec.theta, head_dim), spec.scaling), 1.0
    return _delegated(spec, head_dim, max_positions)
