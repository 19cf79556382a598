"""The DFlash drafter: fused target features injected as keys/values into
bidirectional block layers that predict a whole block of tokens in one pass.

Shapes: B batch, T context length, N blocks (anchors) per sequence, Bs block size,
D hidden size, K captured target layers, H heads, Hd head dim, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash.config.checks import layer_order
from dflash.drafter.attention import BlockLayout, block_sparse_attention
from dflash.drafter.vocab import DraftVocab
from dflash.errors import DFlashError
from dflash.nn.kvcache import KVCache
from dflash.nn.layers import (
    RMSNorm,
    SwiGLU,
    apply_rope,
    merge_heads,
    repeat_kv,
    rope_tables,
    split_heads,
)
from dflash.nn.rope import RopeSpec, rope_frequencies
from dflash.target.model import TargetModel, choose_target_layers

# q[B, H, Q, Hd], k/v[B, Hkv, T+Q, Hd] -> [B, H, Q, Hd] under the training block mask.
AttendFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class DrafterError(DFlashError):
    """A drafter that cannot be built or loaded; the message is one line naming the value."""


class InjectedAttention(nn.Module):
    """Queries from block tokens; keys/values from [context features ; block tokens]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        d, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_eps)

    def _qkv(self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """-> q[B, H, Q, Hd], k/v[B, Hkv, T+Q, Hd] (rotated, normed; not yet repeated)."""
        q_cos, q_sin, kv_cos, kv_sin = rope
        kv_in = torch.cat([ctx, x], dim=1)  # [B, T+Q, D]
        q = self.q_norm(split_heads(self.q_proj(x), self.num_heads))  # [B, H, Q, Hd]
        k = self.k_norm(split_heads(self.k_proj(kv_in), self.num_kv_heads))  # [B, Hkv, T+Q, Hd]
        v = split_heads(self.v_proj(kv_in), self.num_kv_heads)  # [B, Hkv, T+Q, Hd]
        return apply_rope(q, q_cos, q_sin), apply_rope(k, kv_cos, kv_sin), v

    def forward(self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, ...], attend: AttendFn) -> Tensor:
        """x[B, Q, D] block tokens, ctx[B, T, D] fused features."""
        q, k, v = self._qkv(x, ctx, rope)
        out = attend(q, k, v)  # [B, H, Q, Hd]
        return self.o_proj(merge_heads(out))  # [B, Q, D]

    def forward_cached(
        self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, ...], cache: KVCache, layer_idx: int
    ) -> Tensor:
        """One block at inference: ctx[B, Tn, D] holds only the features not yet cached.

        The context's keys/values depend on the features alone (never on x), so they
        are computed once and kept; the caller crops the block's own entries afterwards.
        """
        q, k, v = self._qkv(x, ctx, rope)
        k, v = cache.update(layer_idx, k, v)  # [B, Hkv, T_all+Q, Hd]
        groups = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        out = F.scaled_dot_product_attention(q, k, v)  # one block sees all context: no mask
        return self.o_proj(merge_heads(out))  # [B, Q, D]


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = InjectedAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, ...], attend: AttendFn) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(
        self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, ...], cache: KVCache, layer_idx: int
    ) -> Tensor:
        h = self.self_attn.forward_cached(self.input_layernorm(x), ctx, rope, cache, layer_idx)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DrafterConfig:
    """Drafter geometry; everything but depth, FFN width and block size is the target's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int  # a row of the target's embedding (never a learned vector)
    vocab_size: int  # rows of the shared embedding
    target_spec: str = ""
    num_kv_heads: int = 0  # 0 -> same as num_heads
    rope: RopeSpec = field(default_factory=RopeSpec)
    rms_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    num_target_layers: int = 0  # 0 -> unknown: max(target_layer_ids) + 1
    mask_token_source: str = "explicit"  # how mask_token_id was chosen (see MaskToken)
    draft_vocab_size: int = 0  # 0 -> the whole vocabulary; else rows of its own head

    @property
    def pruned_vocab(self) -> bool:
        return 0 < self.draft_vocab_size < self.vocab_size

    def __post_init__(self) -> None:
        if isinstance(self.rope, dict):
            self.rope = RopeSpec.from_dict(self.rope)
        if self.num_kv_heads == 0:
            self.num_kv_heads = self.num_heads
        if self.num_target_layers == 0:
            self.num_target_layers = max(self.target_layer_ids) + 1
        reason = layer_order(self.target_layer_ids)
        if reason is not None:
            # Its fc columns follow this order; an engine would feed them in another.
            raise DrafterError(
                f"target_layer_ids {self.target_layer_ids}: {reason}, so no engine would "
                "serve this drafter as it was trained"
            )
        if self.block_size < 2:
            raise DrafterError(f"block size {self.block_size} is too small: use at least 2")
        if self.num_heads % self.num_kv_heads:
            raise DrafterError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.draft_vocab_size == self.vocab_size:
            self.draft_vocab_size = 0  # the whole vocabulary: the target's head is shared
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise DrafterError(
                f"draft vocabulary of {self.draft_vocab_size} tokens does not fit the "
                f"target's {self.vocab_size}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DrafterError(
                f"mask token id {self.mask_token_id} is outside the {self.vocab_size} "
                "embedding rows of the target"
            )

    @classmethod
    def for_target(
        cls,
        target: TargetModel,
        *,
        num_layers: int,
        block_size: int,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        mask_token_id: int | None = None,
        draft_vocab_size: int = 0,
    ) -> DrafterConfig:
        """Geometry from the target; K defaults to num_layers, the FFN to the target's.
        The run's defaults for num_layers and block_size live in dflash.config.

        mask_token_id None -> the tokenizer's mask token, else the first spare row
        (TargetModel.mask_token; its error says what to give when neither exists).
        """
        ids = choose_target_layers(target_layer_ids or None, target.num_layers, num_layers)
        geo, mask = target.geometry, target.mask_token(mask_token_id)
        return cls(
            hidden_size=target.hidden_size,
            num_layers=num_layers,
            num_heads=geo.num_heads,
            head_dim=geo.head_dim,
            intermediate_size=intermediate_size or geo.intermediate_size,
            block_size=block_size,
            target_layer_ids=list(ids),
            mask_token_id=mask.token_id,
            vocab_size=target.embed_tokens.num_embeddings,
            target_spec=target.spec,
            num_kv_heads=geo.num_kv_heads,
            rope=geo.rope,
            rms_eps=geo.rms_norm_eps,
            attention_bias=geo.attention_bias,
            max_position_embeddings=geo.max_position_embeddings,
            num_target_layers=target.num_layers,
            mask_token_source=mask.source,
            draft_vocab_size=draft_vocab_size,
        )


class DFlashDrafter(nn.Module):
    """Fusion + KV-injected block layers; the embedding and LM head are the target's.

    The shared modules are held outside the module tree, so `parameters()` and
    `state_dict()` hold only what the drafter trains and saves, under the reference
    DFlash names (fc, hidden_norm, layers.N.self_attn..., norm).
    With a draft vocabulary (`config.pruned_vocab`) the drafter owns a frozen head of
    the target's rows for those tokens and the `d2t`/`t2d` mappings (dflash.drafter.vocab),
    saved as `lm_head.weight`, `d2t` and `t2d`, the names vLLM and speculators read;
    `forward` gives draft-vocabulary logits, the draft_* methods target-vocabulary ones.
    `activation_checkpointing` recomputes each layer in the backward instead of keeping
    its activations; `attention_backend` is a `block_sparse_attention` backend.
    """

    activation_checkpointing: bool = False
    attention_backend: str = "auto"

    def __init__(
        self,
        config: DrafterConfig,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        draft_vocab: DraftVocab | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self._shared = (embed_tokens, lm_head)  # a tuple is not registered as a submodule
        d, k = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(k * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_eps)
        self.apply(self._init_weights)
        if config.pruned_vocab:  # after the init: its rows are the target's
            self._own_head(config, lm_head, draft_vocab)
        # Not a buffer: `.to(bfloat16)` would round the frequencies.
        self._inv_freq, self._rope_scaling = rope_frequencies(
            config.rope, config.head_dim, config.max_position_embeddings
        )

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    def _own_head(
        self, config: DrafterConfig, target_head: nn.Linear, vocab: DraftVocab | None
    ) -> None:
        """The pruned frozen head and its mappings (zeros until `vocab` or a load fills them)."""
        n, w = config.draft_vocab_size, target_head.weight
        head = nn.Linear(w.shape[1], n, bias=False, device=w.device, dtype=w.dtype)
        # Registered by hand: `lm_head` is a property (the shared head otherwise), and
        # add_module refuses a name the class already holds.
        self._modules["lm_head"] = head.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(n, dtype=torch.long, device=w.device))
        self.register_buffer(
            "t2d", torch.zeros(config.vocab_size, dtype=torch.bool, device=w.device)
        )
        if vocab is None:
            return
        if vocab.size != n or vocab.vocab_size != config.vocab_size:
            raise DrafterError(
                f"draft vocabulary of {vocab.size} of {vocab.vocab_size} tokens, the drafter "
                f"config says {n} of {config.vocab_size}"
            )
        with torch.no_grad():
            head.weight.copy_(w[vocab.target_ids.to(w.device)])
            self.d2t.copy_(vocab.d2t())
            self.t2d.copy_(vocab.t2d())

    @property
    def lm_head(self) -> nn.Linear:
        own = self._modules.get("lm_head")
        return own if isinstance(own, nn.Linear) else self._shared[1]

    def draft_labels(self, labels: Tensor) -> tuple[Tensor, Tensor | None]:
        """Target-id labels -> (draft-id labels, in-vocabulary mask); (labels, None) with
        the whole vocabulary. A label outside the draft vocabulary maps to 0 and is out."""
        if not self.config.pruned_vocab:
            return labels, None
        t2d = self.t2d.to(labels.device)
        inside = t2d[labels]
        # Draft id of a kept target id: how many kept ids lie below it.
        draft = torch.cumsum(t2d.long(), 0)[labels] - 1
        return torch.where(inside, draft, torch.zeros_like(draft)), inside

    def target_logits(self, logits: Tensor) -> Tensor:
        """Draft-vocabulary logits[..., N] -> target-vocabulary logits[..., V], -inf at the
        tokens the drafter cannot propose (as vLLM's compute_logits does)."""
        if not self.config.pruned_vocab:
            return logits
        ids = torch.arange(self.config.draft_vocab_size, device=logits.device)
        ids = ids + self.d2t.to(logits.device)
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., ids] = logits
        return out

    @property
    def mask_id(self) -> int:
        """Id put at masked block positions: a row of the target's embedding."""
        return self.config.mask_token_id

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions[B, L] -> cos, sin float32[B, L, Hd], the target's rotary rule."""
        return rope_tables(positions, self._inv_freq, self._rope_scaling)

    def forward(
        self,
        context_hidden: Tensor,
        block_ids: Tensor,
        anchors: Tensor,
        keep: Tensor,
        ctx_start: Tensor | None = None,
    ) -> Tensor:
        """context_hidden[B,T,K*D], block_ids[B,N,Bs], anchors/keep[B,N] -> logits[B,N,Bs,V]."""
        hidden = self.hidden_states(context_hidden, block_ids, anchors, keep, ctx_start)
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))  # [B, N, Bs, V]

    def hidden_states(
        self,
        context_hidden: Tensor,
        block_ids: Tensor,
        anchors: Tensor,
        keep: Tensor,
        ctx_start: Tensor | None = None,
    ) -> Tensor:
        """Final-normed states [B, N, Bs, D] (the LM head's input).

        ctx_start[B, N] (default 0): first context position each block may see, so a
        block of a packed row sees only its own document.
        """
        b, n, bs = block_ids.shape
        t = context_hidden.shape[1]
        ctx = self.hidden_norm(self.fc(context_hidden.to(self.fc.weight.dtype)))  # [B, T, D]
        x = self.embed_tokens(block_ids).reshape(b, n * bs, -1)  # [B, N*Bs, D]
        x = x.to(ctx.dtype)
        offsets = torch.arange(bs, device=anchors.device)
        q_pos = (anchors[:, :, None] + offsets).reshape(b, n * bs)  # [B, N*Bs]
        ctx_pos = torch.arange(t, device=anchors.device).expand(b, t)  # [B, T]
        kv_pos = torch.cat([ctx_pos, q_pos], dim=1)  # [B, T+N*Bs]
        rope = (*self.rope(q_pos), *self.rope(kv_pos))
        layout = BlockLayout(anchors, keep, t, bs, ctx_start)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return block_sparse_attention(q, k, v, layout, backend=self.attention_backend)

        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, ctx, rope, attend, use_reentrant=False)
            else:
                x = layer(x, ctx, rope, attend)
        return self.norm(x).reshape(b, n, bs, -1)  # [B, N, Bs, D]

    def _block(self, anchor_token: int, device: torch.device) -> Tensor:
        block = torch.full((1, 1, self.config.block_size), self.mask_id, device=device)
        block[0, 0, 0] = anchor_token
        return block  # [1, 1, Bs]

    @torch.no_grad()
    def draft_logits(self, context_hidden: Tensor, anchor_token: int, anchor_pos: int) -> Tensor:
        """Logits[Bs-1, V] of the Bs-1 tokens after `anchor_token` at `anchor_pos`.

        context_hidden[1, T, K*D] with T >= anchor_pos; only positions < anchor_pos are seen.
        """
        # The target may sit on another device: draft on the drafter's, answer on the target's.
        device, given = self.fc.weight.device, context_hidden.device
        anchors = torch.tensor([[anchor_pos]], device=device)
        keep = torch.ones(1, 1, dtype=torch.bool, device=device)
        block = self._block(anchor_token, device)
        ctx = context_hidden[:, :anchor_pos].to(device)
        return self.target_logits(self.forward(ctx, block, anchors, keep)[0, 0, 1:]).to(given)

    @torch.no_grad()
    def draft(self, context_hidden: Tensor, anchor_token: int, anchor_pos: int) -> list[int]:
        """Greedy proposal of the Bs-1 tokens after `anchor_token` at `anchor_pos`."""
        return self.draft_logits(context_hidden, anchor_token, anchor_pos).argmax(-1).tolist()

    @torch.no_grad()
    def draft_logits_cached(
        self, new_hidden: Tensor, anchor_token: int, anchor_pos: int, cache: KVCache
    ) -> Tensor:
        """As draft_logits, with the context's keys/values kept in `cache` between calls.

        new_hidden[1, anchor_pos - cache.seq_len(), K*D]: features of the positions the
        cache lacks. On return the cache holds exactly positions < anchor_pos.
        """
        device, given = self.fc.weight.device, new_hidden.device  # see draft_logits
        start, bs = cache.seq_len(), self.config.block_size
        assert new_hidden.shape[1] == anchor_pos - start, "features must continue the cache"
        ctx = self.hidden_norm(self.fc(new_hidden.to(device, self.fc.weight.dtype)))  # [1, Tn, D]
        x = self.embed_tokens(self._block(anchor_token, device)[0]).to(ctx.dtype)  # [1, Bs, D]
        q_pos = torch.arange(anchor_pos, anchor_pos + bs, device=device)[None]  # [1, Bs]
        kv_pos = torch.arange(start, anchor_pos + bs, device=device)[None]  # [1, Tn+Bs]
        rope = (*self.rope(q_pos), *self.rope(kv_pos))
        for i, layer in enumerate(self.layers):
            x = layer.forward_cached(x, ctx, rope, cache, i)
        cache.crop(anchor_pos)  # drop the block's own keys/values
        logits = self.lm_head(self.norm(x).to(self.lm_head.weight.dtype))  # [1, Bs, V]
        return self.target_logits(logits[0, 1:]).to(given)  # [Bs-1, V]
