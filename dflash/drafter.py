"""The DFlash drafter: fused target features injected as keys/values into
bidirectional block layers that predict a whole block of tokens in one pass.

Shapes: B batch, T context length, N blocks (anchors) per sequence, Bs block size,
D hidden size, K captured target layers, H heads, Hd head dim, V vocabulary.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.layers import (
    RMSNorm,
    SwiGLU,
    apply_rope,
    merge_heads,
    repeat_kv,
    rope_cos_sin,
    split_heads,
)

if TYPE_CHECKING:
    from dflash.target import TargetModel


class DrafterError(ValueError):
    """A drafter directory that cannot be loaded."""


class InjectedAttention(nn.Module):
    """Queries from block tokens; keys/values from [context features ; block tokens]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, ...], mask: Tensor) -> Tensor:
        """x[B, Q, D] block tokens, ctx[B, T, D] fused features, mask[B, 1, Q, T+Q]."""
        q_cos, q_sin, kv_cos, kv_sin = rope
        kv_in = torch.cat([ctx, x], dim=1)  # [B, T+Q, D]
        q = self.q_norm(split_heads(self.q_proj(x), self.num_heads))  # [B, H, Q, Hd]
        k = self.k_norm(split_heads(self.k_proj(kv_in), self.num_kv_heads))  # [B, Hkv, T+Q, Hd]
        v = split_heads(self.v_proj(kv_in), self.num_kv_heads)  # [B, Hkv, T+Q, Hd]
        q, k = apply_rope(q, q_cos, q_sin), apply_rope(k, kv_cos, kv_sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # [B, H, T+Q, Hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, Q, Hd]
        return self.o_proj(merge_heads(out))  # [B, Q, D]


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = InjectedAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, ...], mask: Tensor) -> Tensor:
        x = x + self.attn(self.input_norm(x), ctx, rope, mask)
        return x + self.mlp(self.post_attn_norm(x))


@dataclass
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int | None  # the target's mask row; None -> a learned mask embedding
    vocab_size: int  # rows of the shared embedding
    target_spec: str
    num_kv_heads: int = 0  # 0 -> same as num_heads
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_kv_heads == 0:
            self.num_kv_heads = self.num_heads
        if self.block_size < 2:
            raise DrafterError(f"block size {self.block_size} is too small: use at least 2")
        if self.num_heads % self.num_kv_heads:
            raise DrafterError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @classmethod
    def for_target(
        cls,
        target: TargetModel,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
    ) -> DrafterConfig:
        """Sizes from the target (hidden size, heads, FFN); K defaults to num_layers."""
        from dflash.target import default_target_layers, validate_target_layers

        ids = target_layer_ids or default_target_layers(target.num_layers, num_layers)
        validate_target_layers(ids, target.num_layers)
        return cls(
            hidden_size=target.hidden_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            block_size=block_size,
            target_layer_ids=list(ids),
            mask_token_id=target.mask_token_id,
            vocab_size=target.embed_tokens.num_embeddings,
            target_spec=target.spec,
            rope_theta=target.rope_theta,
        )


def block_attention_mask(
    anchors: Tensor,
    keep: Tensor,
    context_len: int,
    block_size: int,
    ctx_start: Tensor | None = None,
) -> Tensor:
    """Training mask: block j sees context positions in [ctx_start[j], anchors[j]) and
    its own block (ctx_start None: from 0; packed rows give each anchor's document start).

    anchors, keep, ctx_start: [B, N] -> BoolTensor[B, 1, N*Bs, T+N*Bs] (True = may
    attend). A padded block (keep False) sees only itself, so no row is all False.
    """
    b, n = anchors.shape
    device = anchors.device
    ctx_pos = torch.arange(context_len, device=device)  # [T]
    sees_ctx = (ctx_pos[None, None, :] < anchors[:, :, None]) & keep[:, :, None]  # [B, N, T]
    if ctx_start is not None:
        sees_ctx &= ctx_pos[None, None, :] >= ctx_start[:, :, None]
    sees_ctx = sees_ctx[:, :, None, :].expand(b, n, block_size, context_len)  # [B, N, Bs, T]
    block_of = torch.arange(n, device=device).repeat_interleave(block_size)  # [N*Bs]
    same_block = block_of[:, None] == block_of[None, :]  # [N*Bs, N*Bs]
    ctx_part = sees_ctx.reshape(b, n * block_size, context_len)  # [B, N*Bs, T]
    blk_part = same_block[None].expand(b, -1, -1)  # [B, N*Bs, N*Bs]
    return torch.cat([ctx_part, blk_part], dim=-1)[:, None]  # [B, 1, N*Bs, T+N*Bs]


class DFlashDrafter(nn.Module):
    """Fusion + KV-injected block layers; the embedding and LM head are the target's.

    The shared modules are held outside the module tree, so `parameters()` and
    `state_dict()` hold only what the drafter trains and saves.
    """

    def __init__(
        self, config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear
    ) -> None:
        super().__init__()
        self.config = config
        self._shared = (embed_tokens, lm_head)  # a tuple is not registered as a submodule
        d, k = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(k * d, d, bias=False)
        self.fc_norm = RMSNorm(d, config.rms_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_eps)
        self.apply(self._init_weights)
        self.mask_embedding: nn.Parameter | None = None
        if config.mask_token_id is None:
            # Start the learned mask at the mean token embedding: a neutral "some token".
            mean_row = embed_tokens.weight.detach().float().mean(0)
            self.mask_embedding = nn.Parameter(mean_row.to(embed_tokens.weight.dtype).clone())

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._shared[1]

    @property
    def mask_id(self) -> int:
        """Id to put at masked block positions (a sentinel == vocab_size when learned)."""
        cid = self.config.mask_token_id
        return cid if cid is not None else self.config.vocab_size

    def embed_block(self, block_ids: Tensor) -> Tensor:
        """block_ids[...] -> embeddings[..., D], swapping in the learned mask if any."""
        if self.mask_embedding is None:
            return self.embed_tokens(block_ids)
        is_mask = block_ids == self.mask_id
        emb = self.embed_tokens(block_ids.masked_fill(is_mask, 0))
        return torch.where(is_mask[..., None], self.mask_embedding.to(emb.dtype), emb)

    def forward(
        self,
        context_hidden: Tensor,
        block_ids: Tensor,
        anchors: Tensor,
        keep: Tensor,
        ctx_start: Tensor | None = None,
    ) -> Tensor:
        """context_hidden[B,T,K*D], block_ids[B,N,Bs], anchors/keep[B,N] -> logits[B,N,Bs,V].

        ctx_start[B, N] (packed rows): first context position each block may see."""
        b, n, bs = block_ids.shape
        t = context_hidden.shape[1]
        ctx = self.fc_norm(self.fc(context_hidden.to(self.fc.weight.dtype)))  # [B, T, D]
        x = self.embed_block(block_ids).reshape(b, n * bs, -1)  # [B, N*Bs, D]
        x = x.to(ctx.dtype)
        offsets = torch.arange(bs, device=anchors.device)
        q_pos = (anchors[:, :, None] + offsets).reshape(b, n * bs)  # [B, N*Bs]
        ctx_pos = torch.arange(t, device=anchors.device).expand(b, t)  # [B, T]
        kv_pos = torch.cat([ctx_pos, q_pos], dim=1)  # [B, T+N*Bs]
        q_cos, q_sin = rope_cos_sin(q_pos, self.config.head_dim, self.config.rope_theta)
        kv_cos, kv_sin = rope_cos_sin(kv_pos, self.config.head_dim, self.config.rope_theta)
        rope = (q_cos, q_sin, kv_cos, kv_sin)
        mask = block_attention_mask(anchors, keep, t, bs, ctx_start)  # [B, 1, N*Bs, T+N*Bs]
        for layer in self.layers:
            x = layer(x, ctx, rope, mask)
        logits = self.lm_head(self.norm(x).to(self.lm_head.weight.dtype))  # [B, N*Bs, V]
        return logits.reshape(b, n, bs, -1)  # [B, N, Bs, V]

    @torch.no_grad()
    def draft(self, context_hidden: Tensor, anchor_token: int, anchor_pos: int) -> list[int]:
        """Greedy proposal of the Bs-1 tokens after `anchor_token` at `anchor_pos`.

        context_hidden[1, T, K*D] with T >= anchor_pos; only positions < anchor_pos are seen.
        """
        device = context_hidden.device
        bs = self.config.block_size
        block = torch.full((1, 1, bs), self.mask_id, dtype=torch.long, device=device)
        block[0, 0, 0] = anchor_token
        anchors = torch.tensor([[anchor_pos]], device=device)
        keep = torch.ones(1, 1, dtype=torch.bool, device=device)
        logits = self.forward(context_hidden[:, :anchor_pos], block, anchors, keep)
        return logits[0, 0, 1:].argmax(-1).tolist()


def save_drafter(drafter: DFlashDrafter, directory: Path | str) -> Path:
    """Write model.safetensors + config.json (with the target spec); files replaced atomically."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    tmp_weights, tmp_config = out / ".model.safetensors.tmp", out / ".config.json.tmp"
    save_file(state, str(tmp_weights))
    tmp_config.write_text(json.dumps(asdict(drafter.config), indent=2))
    os.replace(tmp_weights, out / "model.safetensors")
    os.replace(tmp_config, out / "config.json")
    return out


def load_drafter(
    directory: Path | str,
    target: TargetModel | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[DFlashDrafter, TargetModel]:
    """Load a saved drafter and its target (the saved spec unless `target` is given)."""
    from safetensors.torch import load_file

    from dflash.target import load_target

    path = Path(directory)
    cfg_path, weights_path = path / "config.json", path / "model.safetensors"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise DrafterError(
            f"{directory} is not a saved drafter (needs config.json and model.safetensors)"
        )
    try:
        config = DrafterConfig(**json.loads(cfg_path.read_text()))
    except (json.JSONDecodeError, TypeError) as err:
        raise DrafterError(f"bad drafter config {cfg_path}: {err}") from err
    if target is None:
        target = load_target(config.target_spec, device=device, dtype=dtype)
    drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head)
    try:
        drafter.load_state_dict(load_file(str(weights_path)))
    except (RuntimeError, OSError) as err:
        raise DrafterError(f"drafter weights {weights_path} do not load: {err}") from err
    return drafter.to(device=device, dtype=dtype).eval(), target
