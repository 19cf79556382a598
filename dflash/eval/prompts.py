"""Evaluation prompts from chat JSONL, rendered as the target would see them in serving.

One object per line: `{"messages": [{"role", "content"}, ...]}` (the conversation is
cut after its last user turn), `{"conversations": [...]}` with the same messages or
ShareGPT's `from`/`value`, or the authors' benchmark layout `{"turns": [str, ...]}`
(its first turn is the prompt). A tokenizer with a chat template renders it with the
generation prompt; others (the byte tokenizer) get the plain turn format the
training data uses: `<|role|>\\n` + content + `\\n`, then `<|assistant|>\\n`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from dflash.data.sources import DataReport
from dflash.data.tokenizer import Tokenizer
from dflash.errors import DFlashError

_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}  # any other role is kept as it is


_NO_TURNS = "no chat turns (expected 'messages' with a user turn, 'conversations' or 'turns')"


class PromptError(DFlashError):
    """Evaluation data that cannot be used; the message names the file and line."""


def _message(raw: object) -> dict[str, str] | None:
    if not isinstance(raw, dict):
        return None
    role, content = raw.get("role", raw.get("from")), raw.get("content", raw.get("value"))
    if not isinstance(role, str) or not isinstance(content, str):
        return None
    return {"role": _SHAREGPT_ROLES.get(role, role), "content": content}


def later_turns(obj: object) -> list[str]:
    """The user turns after the first of a `{"turns": [...]}` line (MT-Bench's second
    question): evaluated in order, each after the target's own reply to the one before."""
    turns = obj.get("turns") if isinstance(obj, dict) else None
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        return list(turns[1:])
    return []


def conversation_to_prompt(obj: object) -> list[dict[str, str]] | None:
    """The messages up to and including the last user turn; None when there is none."""
    if not isinstance(obj, dict):
        return None
    turns = obj.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return [{"role": "user", "content": turns[0]}]
    raw = obj.get("messages", obj.get("conversations"))
    if not isinstance(raw, list):
        return None
    messages = [m for m in map(_message, raw) if m is not None]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    return None if last_user is None else messages[: last_user + 1]


def render_prompt(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` followed by the assistant's generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return [int(i) for i in ids]
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if isinstance(bos, int) else []) + list(tokenizer.encode(text))


class TokenPrompts(NamedTuple):
    """A run's OUTPUT_DIR/eval_prompts.json: the token ids its τ was measured on."""

    prompts: list[list[int]]
    max_new_tokens: int | None  # the run's budget per prompt


def read_token_prompts(path: Path | str, limit: int | None = None) -> TokenPrompts | None:
    """The prompts of a run's eval_prompts.json, so that `eval` (in process or `--server`)
    measures a drafter on the very prompts its run did; None when `path` is not such a
    file (chat JSONL)."""
    source = Path(path)
    if source.suffix != ".json":
        return None
    try:
        record = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # read_conversations names what is wrong with it
    if not isinstance(record, dict) or "prompts" not in record:
        return None
    prompts = record["prompts"]
    if not (
        isinstance(prompts, list)
        and prompts
        and all(
            isinstance(p, list) and p and all(type(i) is int and i >= 0 for i in p) for p in prompts
        )
    ):
        raise PromptError(
            f"--eval-data {source}: 'prompts' is not a list of token-id lists (a run's "
            "eval_prompts.json holds one)"
        )
    budget = record.get("max_new_tokens")
    return TokenPrompts(
        prompts[:limit] if limit is not None else prompts,
        budget if type(budget) is int else None,
    )


def read_conversations(
    path: Path | str,
    limit: int | None = None,
    report: DataReport | None = None,
    followups: list[list[str]] | None = None,
) -> list[list[dict[str, str]]]:
    """Each line's messages up to its last user turn. Lines without one (or not JSON)
    are skipped and counted in `report`; none usable at all is a PromptError.
    `followups`, when given, gets each conversation's later turns (`later_turns`)."""
    source = Path(path)
    report = report if report is not None else DataReport()
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PromptError(f"--eval-data {path}: cannot read it ({err})") from err
    conversations: list[list[dict[str, str]]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            messages = conversation_to_prompt(json.loads(line))
        except json.JSONDecodeError as err:
            report.skip(f"{source}:{lineno}", f"malformed JSON ({err.msg})")
            continue
        if messages is None:
            report.skip(f"{source}:{lineno}", _NO_TURNS)
            continue
        conversations.append(messages)
        if followups is not None:
            followups.append(later_turns(json.loads(line)))
        if limit is not None and len(conversations) >= limit:
            break
    if not conversations:
        skipped = f" (skipped {report.skipped_lines} lines; first: {report.first_bad_line})"
        raise PromptError(
            f"--eval-data {source}: no chat turns in the file"
            + (skipped if report.skipped_lines else "")
        )
    return conversations


def load_chat_prompts(
    path: Path | str,
    tokenizer: Tokenizer,
    limit: int | None = None,
    report: DataReport | None = None,
) -> list[list[int]]:
    """Rendered prompts of a chat JSONL file (see `read_conversations`)."""
    return [render_prompt(tokenizer, m) for m in read_conversations(path, limit, report)]
