"""Plain decoding with the target: the baseline and reference of speculative decoding,
and the generator for regenerating training replies with the target itself.

With `use_cache` the target keeps a KV cache (its own DynamicCache for Hugging Face
targets) and each step runs one token; without it every step re-reads the sequence.
Both give the same tokens; the cache-less path exists as the simple reference.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from dflash.target.decoding import GenerationError, check_decoding
from dflash.target.model import TargetModel


def token_probs(logits: Tensor, temperature: float) -> Tensor:
    """logits[..., V] -> float32 probabilities at `temperature` (> 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_from(probs: Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs[V] (on the CPU, so a CPU generator works for any device)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def next_token(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """logits[V] -> argmax at temperature 0, else a sample at `temperature`."""
    if temperature == 0:
        return int(logits.argmax())
    return sample_from(token_probs(logits, temperature), generator)


def ids_tensor(tokens: list[int], device: torch.device) -> Tensor:
    return torch.tensor([tokens], dtype=torch.long, device=device)  # [1, T]


def first_stop(tokens: list[int], stop_token_ids: Iterable[int]) -> int | None:
    """Index of the first stop token in `tokens`, or None."""
    stops = set(stop_token_ids)
    return next((i for i, t in enumerate(tokens) if t in stops), None)


def _finish(new: list[int], max_new_tokens: int, stop_token_ids: Iterable[int]) -> list[int]:
    """Truncate to the budget and just after the first stop token (which is kept)."""
    new = new[:max_new_tokens]
    stop = first_stop(new, stop_token_ids)
    return new if stop is None else new[: stop + 1]


@torch.no_grad()
def generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    stop_token_ids: Iterable[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> list[int]:
    """The target's own continuation of a non-empty prompt, ending after a stop token."""
    check_decoding(max_new_tokens, temperature)
    if not prompt_ids:
        raise GenerationError("generation needs a non-empty prompt")
    stops = set(stop_token_ids)
    device = target.device
    cache = target.new_cache() if use_cache else None
    seq, step_input = list(prompt_ids), list(prompt_ids)
    while len(seq) - len(prompt_ids) < max_new_tokens:
        if cache is not None:
            logits = target.forward_cached(ids_tensor(step_input, device), cache).logits
        else:
            logits = target.logits(ids_tensor(seq, device))  # [1, T, V]
        token = next_token(logits[0, -1], temperature, generator)
        seq.append(token)
        step_input = [token]
        if token in stops:
            break
    return _finish(seq[len(prompt_ids) :], max_new_tokens, stops)


def greedy_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    stop_token_ids: Iterable[int] = (),
    use_cache: bool = True,
) -> list[int]:
    """Greedy decoding: the reference output of speculative decoding at temperature 0."""
    return generate(
        target, prompt_ids, max_new_tokens, stop_token_ids=stop_token_ids, use_cache=use_cache
    )


def _next_tokens(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """logits[B, V] -> ids[B]: greedy at temperature 0, else one sample per row."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = token_probs(logits, temperature)
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)


@torch.no_grad()
def generate_batch(
    target: TargetModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Iterable[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """New tokens of each prompt, up to and without the first stop token, at most
    max_new_tokens. The prompts share one KV cache, so they must have one length
    (regeneration batches them by length)."""
    check_decoding(max_new_tokens, temperature)
    if not prompts or len({len(p) for p in prompts}) != 1 or not prompts[0]:
        raise GenerationError("generate_batch needs non-empty prompts of one length")
    stop_list = list(stop_token_ids)
    ids = torch.tensor(prompts, dtype=torch.long, device=target.device)  # [B, L]
    cache = target.new_cache()
    stops = torch.tensor(stop_list or [-1], device=ids.device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=ids.device)
    out: list[Tensor] = []
    step_ids = ids
    for _ in range(max_new_tokens):
        logits = target.forward_cached(step_ids, cache).logits[:, -1]  # [B, V]
        token = _next_tokens(logits, temperature, generator)  # [B]
        out.append(token)
        done |= torch.isin(token, stops)
        if bool(done.all()):  # one host read per token: the loop must know when to stop
            break
        step_ids = token[:, None]
    return _until_stops(torch.stack(out, dim=1).tolist(), stop_list)  # [B, steps]


def _until_stops(rows: list[list[int]], stop_token_ids: list[int]) -> list[list[int]]:
    """Each row up to and without its first stop token."""
    cuts = [first_stop(row, stop_token_ids) for row in rows]
    return [row if cut is None else row[:cut] for row, cut in zip(rows, cuts, strict=True)]


@torch.no_grad()
def generate_padded(
    target: TargetModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Iterable[int],
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """New tokens of prompts of any length decoded together (a Hugging Face target):
    left padding, an attention mask and one KV cache, and a row leaves the batch (and
    the cache) at its first stop token, so the rest decode without it. Each row ends
    up to and without that stop token, at most max_new_tokens. Greedy rows equal
    transformers' `generate` of each prompt alone. Only the given settings decode: the
    model's generation_config (top-k, top-p, repetition penalty) is not applied;
    sampling is seeded by `seed`."""
    check_decoding(max_new_tokens, temperature)
    if not prompts or not all(prompts):
        raise GenerationError("generate_padded needs non-empty prompts")
    stop_list, device = list(stop_token_ids), target.device
    pad = getattr(target.tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (stop_list[0] if stop_list else 0)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every row ends at the same place
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as transformers' generate numbers them
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    stops = torch.tensor(stop_list or [-1], device=device)
    cache = target.new_cache()
    rows = list(range(len(prompts)))  # the prompt of each row still in the batch
    out: list[list[int]] = [[] for _ in prompts]
    step_ids, step_pos = ids, positions
    for _ in range(max_new_tokens):
        inputs = {"input_ids": step_ids, "attention_mask": mask, "position_ids": step_pos}
        logits = target.model(**inputs, past_key_values=cache, use_cache=True).logits[:, -1]
        token = _next_tokens(logits.float(), temperature, generator)  # [n]
        for row, new in zip(rows, token.tolist(), strict=True):  # one host read per token
            out[row].append(new)
        done = torch.isin(token, stops)
        last = step_pos[:, -1]
        if bool(done.any()):
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            rows = [rows[i] for i in keep.tolist()]
            token, mask, last = token[keep], mask[keep], last[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        step_ids, step_pos = token[:, None], last[:, None] + 1
    return _until_stops(out, stop_list)
