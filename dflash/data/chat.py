"""Conversations to token ids: the loss mask and the turn boundaries.

A rendered conversation carries where it may be cut (`turn_ends`): packing
truncates a conversation too long for a row at one of these, never mid-turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash.data.tokenizer import encode_texts

KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class RenderedChat:
    ids: np.ndarray  # [n] int32
    mask: np.ndarray  # [n] bool: True on assistant reply tokens
    turn_ends: np.ndarray  # [m] int64, ascending: token counts after which a cut is clean


def plain_turn_header(role: str) -> str:
    """Header of a turn for tokenizers without a chat template."""
    return f"<|{role}|>\n"


def _render_plain(tokenizer: Any, messages: list[dict]) -> RenderedChat:
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    ends: list[int] = []
    total = 0
    for msg in messages:
        header, body = encode_texts(
            tokenizer, [plain_turn_header(msg["role"]), msg["content"] + "\n"]
        )
        ids += [header, body]
        mask += [np.zeros(len(header), bool), np.full(len(body), msg["role"] == "assistant")]
        total += len(header) + len(body)
        ends.append(total)
    return RenderedChat(np.concatenate(ids), np.concatenate(mask), np.asarray(ends, np.int64))


def _mask_run_ends(mask: np.ndarray) -> np.ndarray:
    """Token counts at which a run of True ends (after each assistant reply)."""
    padded = np.concatenate([mask, [False]])
    return (np.flatnonzero(padded[:-1] & ~padded[1:]) + 1).astype(np.int64)


def _render_generation_mask(tokenizer: Any, messages: list[dict]) -> RenderedChat | None:
    """Templates with `{% generation %}` give the assistant mask directly."""
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except (ValueError, KeyError, TypeError):
        return None  # the template has no generation markers
    mask = np.asarray(out["assistant_masks"], dtype=bool)
    if not mask.any():
        return None
    ids = np.asarray(out["input_ids"], dtype=np.int32)
    ends = np.unique(np.concatenate([_mask_run_ends(mask), [len(ids)]]))
    return RenderedChat(ids, mask, ends)


def _render_prefixes(tokenizer: Any, messages: list[dict]) -> RenderedChat:
    """Rendered prefix by prefix; the assistant header (generation prompt) is not learned."""
    segments: list[tuple[str, bool, bool]] = []  # (text, learned, ends a turn)
    done = ""
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            head = tokenizer.apply_chat_template(
                messages[:i], tokenize=False, add_generation_prompt=True
            )
            segments.append((head[len(done) :] if head.startswith(done) else head, False, False))
            done = head
        text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        segment = text[len(done) :] if text.startswith(done) else text
        segments.append((segment, msg["role"] == "assistant", True))
        done = text
    encoded = encode_texts(tokenizer, [s for s, _, _ in segments])
    mask = np.concatenate(
        [np.full(len(e), m) for e, (_, m, _) in zip(encoded, segments, strict=True)]
    )
    lengths = np.cumsum([len(e) for e in encoded])
    ends = np.asarray(
        [n for n, (_, _, end) in zip(lengths, segments, strict=True) if end], np.int64
    )
    return RenderedChat(np.concatenate(encoded), mask, ends)


def render_chat(tokenizer: Any, messages: list[dict]) -> RenderedChat:
    """ids, loss mask (assistant turns only) and turn ends of one conversation."""
    if not getattr(tokenizer, "chat_template", None):
        return _render_plain(tokenizer, messages)
    return _render_generation_mask(tokenizer, messages) or _render_prefixes(tokenizer, messages)


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Ids of the conversation so far followed by the assistant's header: what a
    model is given to write the next assistant turn."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return encode_texts(tokenizer, [text])[0].tolist()
    ids = _render_plain(tokenizer, messages).ids if messages else np.zeros(0, np.int32)
    header = encode_texts(tokenizer, [plain_turn_header("assistant")])[0]
    return np.concatenate([ids, header]).astype(np.int64).tolist()
