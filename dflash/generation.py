"""KV-cached decoding of a batch of equal-length prompts on a target.

`generate_batch` is the one entry point regeneration uses, so a shared
implementation of target KV caches can replace what is below without touching
its callers. Hugging Face targets use their own cache objects; the built-in tiny
LM gets a small per-layer key/value cache here, built from its own modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.layers import apply_rope, merge_heads, rope_cos_sin, split_heads
from dflash.target import TargetModel
from dflash.tiny import TinyLM

KVCache = list[tuple[Tensor, Tensor]]


def _tiny_forward(model: TinyLM, ids: Tensor, start: int, cache: KVCache) -> Tensor:
    """ids[B, L] at positions start.. -> last-position logits[B, V]; appends to cache.

    Only a prefill (empty cache) or one token at a time: the causal mask is then
    either the plain one or not needed.
    """
    cfg = model.config
    b, length = ids.shape
    positions = torch.arange(start, start + length, device=ids.device).expand(b, length)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    x = model.embed_tokens(ids)  # [B, L, D]
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        q, k, v = attn.qkv_proj(layer.input_norm(x)).chunk(3, dim=-1)  # 3 x [B, L, D]
        q = apply_rope(split_heads(q, attn.num_heads), cos, sin)  # [B, H, L, Hd]
        k = apply_rope(split_heads(k, attn.num_heads), cos, sin)  # [B, H, L, Hd]
        v = split_heads(v, attn.num_heads)
        if i < len(cache):
            k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
            cache[i] = (k, v)
        else:
            cache.append((k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=length > 1)  # [B, H, L, Hd]
        x = x + attn.o_proj(merge_heads(out))
        x = x + layer.mlp(layer.post_attn_norm(x))
    return model.lm_head(model.norm(x[:, -1]))  # [B, V]


def _next_token(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """logits[B, V] -> ids[B]: greedy at temperature 0, else a sample."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)


@torch.no_grad()
def generate_batch(
    target: TargetModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """New tokens of each prompt (all the same length), up to and without the first
    stop token, at most max_new_tokens."""
    assert prompts and len({len(p) for p in prompts}) == 1
    ids = torch.tensor(prompts, dtype=torch.long, device=target.device)  # [B, L]
    model, is_tiny = target.model, isinstance(target.model, TinyLM)
    cache: KVCache = []
    hf_cache = None
    out: list[Tensor] = []
    done = torch.zeros(len(prompts), dtype=torch.bool, device=ids.device)
    stops = torch.tensor(stop_token_ids or [-1], device=ids.device)
    step_ids, start = ids, 0
    for _ in range(max_new_tokens):
        if is_tiny:
            logits = _tiny_forward(model, step_ids, start, cache)
        else:
            res = model(input_ids=step_ids, past_key_values=hf_cache, use_cache=True)
            logits, hf_cache = res.logits[:, -1], res.past_key_values
        token = _next_token(logits, temperature, generator)  # [B]
        out.append(token)
        done |= torch.isin(token, stops)
        if bool(done.all()):
            break
        start += step_ids.shape[1]
        step_ids = token[:, None]
    tokens = torch.stack(out, dim=1).tolist()  # [B, steps]
    result = []
    for row in tokens:
        cut = next((j for j, t in enumerate(row) if t in stop_token_ids), len(row))
        result.append(row[:cut])
    return result
