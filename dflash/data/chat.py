"""Conversations to token ids: the loss mask and the turn boundaries.

A rendered conversation carries where it may be cut (`turn_ends`): packing
truncates a conversation too long for a row at one of these, never mid-turn.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash.data.tokenizer import Tokenizer, encode_texts
from dflash.errors import DFlashError

KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
CHAT_RENDERINGS = ("whole", "per-turn")  # --chat-rendering, declared in dflash.config


@dataclass(frozen=True)
class RenderedChat:
    ids: np.ndarray  # [n] int32
    mask: np.ndarray  # [n] bool: True on assistant reply tokens
    turn_ends: np.ndarray  # [m] int64, ascending: token counts after which a cut is clean


def plain_turn_header(role: str) -> str:
    """Header of a turn for tokenizers without a chat template."""
    return f"<|{role}|>\n"


def _render_plain(tokenizer: Tokenizer, messages: list[dict]) -> RenderedChat:
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


_GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")


def _render_generation_mask(tokenizer: Tokenizer, messages: list[dict]) -> RenderedChat | None:
    """Templates with `{% generation %}` give the assistant mask directly."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and not _GENERATION_MARK.search(template):
        return None  # no markers: asking would only log a warning per conversation
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


class ChatTemplateError(DFlashError):
    """A chat template whose rendering does not show the conversation's replies as written."""


_PROBE = "dflash-probe-reply-7f3a"


# tokenizer -> (its template, the suffix found for it): one probe per template, not one
# per conversation.
_suffixes: weakref.WeakKeyDictionary[Tokenizer, tuple[str, str]] = weakref.WeakKeyDictionary()


def _assistant_suffix(tokenizer: Tokenizer) -> str:
    """What the template writes after an assistant reply's text (its end-of-turn marker),
    learned from a probe conversation rendered once per template."""
    template = str(tokenizer.chat_template)
    known = _suffixes.get(tokenizer)
    if known is not None and known[0] == template:
        return known[1]
    question = {"role": "user", "content": "dflash-probe-question"}
    probe = [question, {"role": "assistant", "content": _PROBE}]
    text = tokenizer.apply_chat_template(probe, tokenize=False)
    at = text.rfind(_PROBE)
    suffix = text[at + len(_PROBE) :] if at >= 0 else ""
    _suffixes[tokenizer] = (template, suffix)
    return suffix


def _render_spans(tokenizer: Tokenizer, messages: list[dict]) -> RenderedChat:
    """The whole conversation rendered once; each message's text located in it, in order.

    Templates may rewrite earlier turns once a later one exists (Qwen3 drops the empty
    think block of earlier answers), so the rendering is never assumed to extend the
    rendering of a shorter conversation. A reply is learned with the template's
    end-of-turn marker that follows it (the target generates that, then stops); what
    the template puts before it (headers, an empty think block) is context."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    suffix = _assistant_suffix(tokenizer)
    learned_suffix = suffix.rstrip()
    spans: list[tuple[int, int]] = []  # learned character ranges
    turn_ends: list[int] = []
    cursor = 0
    for number, msg in enumerate(messages, 1):
        content = msg["content"]
        at = full.find(content, cursor) if content else -1
        if at < 0:
            if msg["role"] == "assistant" and content:
                raise ChatTemplateError(
                    f"the chat template's rendering does not contain reply {number} as written "
                    f"({content[:40]!r}): its assistant spans cannot be found"
                )
            continue  # a template may rewrite or drop a system or an empty message
        end = at + len(content)
        if msg["role"] == "assistant":
            tail = len(learned_suffix) if full.startswith(learned_suffix, end) else 0
            spans.append((at, end + tail))
        turn_ends.append(end + len(suffix) if suffix and full.startswith(suffix, end) else end)
        cursor = end
    boundaries = sorted({0, len(full), *turn_ends, *(c for span in spans for c in span)})
    ranges = list(zip(boundaries, boundaries[1:], strict=False))
    pieces = [full[a:b] for a, b in ranges]
    flags = [any(a <= lo and hi <= b for a, b in spans) for lo, hi in ranges]
    assert "".join(pieces) == full  # verified against the whole rendering
    encoded = encode_texts(tokenizer, pieces)
    mask = np.concatenate([np.full(len(e), f) for e, f in zip(encoded, flags, strict=True)])
    lengths = dict(zip(boundaries[1:], np.cumsum([len(e) for e in encoded]), strict=True))
    ends = np.asarray(sorted({int(lengths[t]) for t in turn_ends if t in lengths}), np.int64)
    return RenderedChat(np.concatenate(encoded).astype(np.int32), mask, ends)


def use_chat_template_kwargs(tokenizer: Tokenizer, kwargs: dict[str, object]) -> None:
    """Every rendering of a conversation by `tokenizer` gets `kwargs` (e.g.
    enable_thinking=False); an argument given at a call still wins."""
    if not kwargs or not hasattr(tokenizer, "apply_chat_template"):
        return
    original = type(tokenizer).apply_chat_template

    # Any: the tokenizer's own method's arguments and result, passed through as they are
    def apply_chat_template(conversation: Any, *args: Any, **given: Any) -> Any:
        return original(tokenizer, conversation, *args, **{**kwargs, **given})

    tokenizer.apply_chat_template = apply_chat_template
    _suffixes.pop(tokenizer, None)  # found without these arguments


def render_chat(tokenizer: Tokenizer, messages: list[dict]) -> RenderedChat:
    """ids, loss mask (assistant turns only) and turn ends of one conversation."""
    if not getattr(tokenizer, "chat_template", None):
        return _render_plain(tokenizer, messages)
    return _render_generation_mask(tokenizer, messages) or _render_spans(tokenizer, messages)


def render_turns(tokenizer: Tokenizer, messages: list[dict]) -> list[RenderedChat]:
    """One document per assistant reply, as a server prompts for it (`--chat-rendering
    per-turn`): the turns before the reply rendered with the generation prompt
    (`chat_prompt_ids`: the template with add_generation_prompt=True and the template
    arguments) are context; the reply and the template's end-of-turn marker are learned.

    Separate documents, not one row holding every turn: a template's prompt for reply k
    need not be a prefix of its prompt for reply k+1 (a non-thinking Qwen3 puts an empty
    think block before the reply it prompts for, which its rendering of that reply as
    history leaves out), so no one token sequence shows each reply after the very tokens
    the server gives the target for it. The earlier turns are read again for every reply
    (tokens grow with the square of the turns), as context only. A reply with no turn
    before it has no prompt a server would give and is left out; a document is never cut
    (one longer than a row is dropped and counted, as a chat whose first reply does not
    fit)."""
    out: list[RenderedChat] = []
    for number, msg in enumerate(messages):
        if msg["role"] != "assistant" or not msg["content"] or number == 0:
            continue
        prompt = np.asarray(chat_prompt_ids(tokenizer, messages[:number]), np.int32)
        (reply,) = encode_texts(tokenizer, [msg["content"] + _reply_end(tokenizer)])
        ids = np.concatenate([prompt, reply]).astype(np.int32)
        mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(reply), bool)])
        out.append(RenderedChat(ids, mask, np.asarray([len(ids)], np.int64)))
    return out


def _reply_end(tokenizer: Tokenizer) -> str:
    """What follows a reply and is learned with it, as in the whole rendering: the
    template's end-of-turn marker (the target writes it, then stops), or the newline
    that ends a turn without a template."""
    if getattr(tokenizer, "chat_template", None):
        return _assistant_suffix(tokenizer).rstrip()
    return "\n"


def render_documents(
    tokenizer: Tokenizer, messages: list[dict], rendering: str
) -> list[RenderedChat]:
    """The documents of one conversation by --chat-rendering: `whole` (one, `render_chat`)
    or `per-turn` (one per reply, `render_turns`)."""
    if rendering == "whole":
        return [render_chat(tokenizer, messages)]
    if rendering == "per-turn":
        return render_turns(tokenizer, messages)
    raise DFlashError(
        f"--chat-rendering {rendering!r}: expected one of {', '.join(CHAT_RENDERINGS)}"
    )


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """Ids of the conversation so far followed by the assistant's header: what a
    model is given to write the next assistant turn."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return encode_texts(tokenizer, [text])[0].tolist()
    ids = _render_plain(tokenizer, messages).ids if messages else np.zeros(0, np.int32)
    header = encode_texts(tokenizer, [plain_turn_header("assistant")])[0]
    return np.concatenate([ids, header]).astype(np.int64).tolist()
