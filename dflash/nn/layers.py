"""Building blocks shared by the built-in tiny target and the drafter.

Llama conventions throughout: pre-norm RMSNorm, rotary embeddings in the
"rotate half" layout, SwiGLU feed-forward. Shapes: B batch, L length,
H heads, Hd head dim, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain; computed in fp32 for bf16 stability."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    """Gated feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_tables(
    positions: Tensor, inv_freq: Tensor, attention_scaling: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos/sin tables for arbitrary (not necessarily contiguous) positions.

    positions: LongTensor[B, L], inv_freq: float32[Hd/2] -> cos, sin: float32 [B, L, Hd].
    The drafter needs arbitrary positions because block tokens sit at anchor+k.
    """
    angles = positions.float()[..., None] * inv_freq.to(positions.device)  # [B, L, Hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, L, Hd]
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Plain (unscaled) rope tables: positions[B, L] -> cos, sin float32[B, L, Hd]."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    return rope_tables(positions, 1.0 / (theta**exponents))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x[B, H, L, Hd] by per-position angles cos/sin[B, L, Hd]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [B, 1, L, Hd]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """[B, L, H*Hd] -> [B, H, L, Hd]."""
    b, length, _ = x.shape
    return x.view(b, length, num_heads, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """[B, H, L, Hd] -> [B, L, H*Hd]."""
    b, h, length, hd = x.shape
    return x.transpose(1, 2).reshape(b, length, h * hd)


def repeat_kv(x: Tensor, num_groups: int) -> Tensor:
    """Grouped-query attention: [B, Hkv, L, Hd] -> [B, Hkv*groups, L, Hd]."""
    if num_groups == 1:
        return x
    return x.repeat_interleave(num_groups, dim=1)
