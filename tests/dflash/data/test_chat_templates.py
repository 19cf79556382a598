"""Any chat template: a conversation is rendered once and its assistant spans are found in
that rendering, so a template that rewrites earlier turns (Qwen3) does not corrupt it."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from dflash.data.chat import ChatTemplateError, render_chat, render_turns, use_chat_template_kwargs

TEMPLATES = Path(__file__).parent / "templates"
LLAMA3 = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim "
    "+ '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
NO_SYSTEM = (  # as Gemma's: no system role, `model` for the assistant
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' "
    "+ m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
SPECIALS = [  # the special tokens of qwen3.jinja, LLAMA3 and NO_SYSTEM
    *("<|im_start|>", "<|im_end|>"),
    *("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    *("<start_of_turn>", "<end_of_turn>", "<bos>"),
]


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE (any text round-trips) with the templates' special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet
    )
    raw.train_from_iterator(["user assistant system think hello how are you"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<|im_end|>")


CHAT = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "second answer"},
]


def learned_text(tokenizer, rendered) -> list[str]:
    """The learned token runs, decoded."""
    runs, current = [], []
    for token, learned in zip(rendered.ids.tolist(), rendered.mask.tolist(), strict=True):
        if learned:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def with_template(tokenizer, template: str):
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.slow  # imports transformers
@pytest.mark.parametrize(
    ("template", "end_of_turn"),
    [
        ((TEMPLATES / "qwen3.jinja").read_text(), "<|im_end|>"),
        (LLAMA3, "<|eot_id|>"),
        (NO_SYSTEM, "<end_of_turn>"),
    ],
    ids=["qwen3", "llama3", "no-system-role"],
)
def test_the_whole_conversation_once_with_each_reply_and_its_end_of_turn_learned(
    byte_tokenizer, template, end_of_turn
) -> None:
    tok = with_template(byte_tokenizer, template)
    rendered = render_chat(tok, CHAT)
    full = tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode(rendered.ids.tolist()) == full  # the rendering of the whole, once
    assert full.count("first question") == 1
    replies = [f"first answer{end_of_turn}", f"second answer{end_of_turn}"]
    assert learned_text(tok, rendered) == replies
    assert rendered.turn_ends[-1] <= len(rendered.ids) and np.all(np.diff(rendered.turn_ends) > 0)


@pytest.mark.slow
def test_qwen3_rewrites_earlier_turns_and_its_think_block_is_context(byte_tokenizer) -> None:
    tok = with_template(byte_tokenizer, (TEMPLATES / "qwen3.jinja").read_text())
    first_turn = tok.apply_chat_template(CHAT[:2], tokenize=False)
    assert not tok.apply_chat_template(CHAT, tokenize=False).startswith(first_turn)
    decoded = tok.decode(render_chat(tok, CHAT).ids.tolist())
    assert decoded.count("<think>") == 1  # the last reply's empty think block, not learned


def non_thinking_qwen3(byte_tokenizer):
    """The real Qwen3 template with --chat-template-kwargs '{"enable_thinking": false}', on
    a copy: the arguments stay with this tokenizer, not the module's fixture."""
    tok = copy.deepcopy(with_template(byte_tokenizer, (TEMPLATES / "qwen3.jinja").read_text()))
    use_chat_template_kwargs(tok, {"enable_thinking": False})
    return tok


@pytest.mark.slow
def test_enable_thinking_false_leaves_qwen3s_whole_rendering_as_it_was(byte_tokenizer) -> None:
    thinking = with_template(byte_tokenizer, (TEMPLATES / "qwen3.jinja").read_text())
    before = render_chat(thinking, CHAT)
    after = render_chat(non_thinking_qwen3(byte_tokenizer), CHAT)
    # The template reads the flag in the generation prompt only.
    assert after.ids.tolist() == before.ids.tolist()
    assert after.mask.tolist() == before.mask.tolist()


@pytest.mark.slow
def test_per_turn_learns_each_reply_after_the_prompt_a_non_thinking_server_gives(
    byte_tokenizer,
) -> None:
    tok = non_thinking_qwen3(byte_tokenizer)
    turns = render_turns(tok, CHAT)
    assert len(turns) == 2
    for turn, upto, reply in ((turns[0], 1, "first answer"), (turns[1], 3, "second answer")):
        prompt = tok.apply_chat_template(CHAT[:upto], tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert tok.decode(turn.ids.tolist()) == f"{prompt}{reply}<|im_end|>"
        assert learned_text(tok, turn) == [f"{reply}<|im_end|>"]  # the prompt is context
        assert turn.turn_ends.tolist() == [len(turn.ids)]  # never cut inside
    # The whole rendering learns the first reply after `<|im_start|>assistant\n` alone.
    whole = render_chat(tok, CHAT)
    assert learned_text(tok, whole) == ["first answer<|im_end|>", "second answer<|im_end|>"]
    first = int(np.flatnonzero(whole.mask)[0])
    assert tok.decode(whole.ids[:first].tolist()).endswith("<|im_start|>assistant\n")
    prompt_len = int(np.flatnonzero(turns[0].mask)[0])
    assert whole.ids[:first].tolist() != turns[0].ids[:prompt_len].tolist()
    assert len(whole.ids) < sum(len(t.ids) for t in turns)  # turn 1 is read twice


def test_per_turn_without_a_template_is_the_whole_rendering_cut_after_each_reply() -> None:
    from dflash.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    whole = render_chat(tok, CHAT)
    ends = [int(e) for e in whole.turn_ends]  # after turns 1..4
    turns = render_turns(tok, CHAT)
    for turn, end in zip(turns, (ends[1], ends[3]), strict=True):
        assert turn.ids.tolist() == whole.ids[:end].tolist()
        assert turn.mask[: ends[0]].sum() == 0 and turn.mask[-1]
    assert turns[1].mask.sum() == len("second answer\n")  # only its own reply
    # A reply with nothing before it has no prompt a server would give: left out.
    assert render_turns(tok, [{"role": "assistant", "content": "hello"}]) == []


@pytest.mark.slow
def test_a_template_that_changes_a_reply_is_one_line(byte_tokenizer) -> None:
    shouting = "{% for m in messages %}<|im_start|>{{ m['content'] | upper }}<|im_end|>{% endfor %}"
    tok = with_template(byte_tokenizer, shouting)
    with pytest.raises(ChatTemplateError, match="reply 2 as written") as info:
        render_chat(tok, CHAT)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_no_eos_is_learned_after_the_templates_end_of_turn(byte_tokenizer) -> None:
    from dflash.data.packing import Document, frame

    tok = with_template(byte_tokenizer, (TEMPLATES / "qwen3.jinja").read_text())
    rendered = render_chat(tok, CHAT)
    document = Document("chat", rendered.ids, rendered.mask, True, rendered.turn_ends)
    doc = frame(document, None, tok.eos_token_id)
    assert tok.decode(doc.ids.tolist()).endswith("second answer<|im_end|>\n")
    assert doc.ids.tolist() == rendered.ids.tolist()  # nothing appended


@pytest.mark.slow
def test_chat_template_kwargs_reach_every_rendering_of_the_target(tmp_path) -> None:
    from dflash.data.chat import chat_prompt_ids
    from dflash.target.load import load_target
    from tests.dflash.hf_fixtures import save_hf_target

    target = load_target(str(save_hf_target(tmp_path / "t")))
    target.tokenizer.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    prompt = [{"role": "user", "content": "x"}]

    def rendered() -> str:
        return target.tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True
        )

    thinking = rendered()
    target.use_chat_template_kwargs({"enable_thinking": False})
    assert rendered() == thinking + "<think>\n\n</think>\n\n"  # a non-thinking prompt
    assert len(chat_prompt_ids(target.tokenizer, prompt)) > len(
        target.tokenizer(thinking, add_special_tokens=False)["input_ids"]
    )
    # An argument given at a call still wins.
    again = target.tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert again == thinking


@pytest.mark.slow
def test_inspect_data_shows_learned_spans_and_writes_documents(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from dflash import cli
    from tests.dflash.hf_fixtures import save_hf_target

    target = save_hf_target(tmp_path / "t")
    chats = tmp_path / "chats.jsonl"
    messages = [
        {"role": "user", "content": "def add a b"},
        {"role": "assistant", "content": "return a"},
    ]
    chats.write_text(json.dumps({"messages": messages}) + "\n")
    out = tmp_path / "docs.json"
    paths = ["--target", str(target), "--data", str(chats)]
    args = ["inspect-data", *paths, "--seq-len", "32", "--rows", "1", "--json", str(out)]
    result = CliRunner().invoke(cli.cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "⟦return a </s>⟧" in result.output.replace("  ", " ")
    assert "──── document 0 ────" in result.output and "1 training documents" in result.output
    (doc,) = json.loads(out.read_text())
    assert set(doc) == {"text", "tokens", "loss_mask"}
    assert len(doc["tokens"]) == len(doc["loss_mask"]) and 0 < sum(doc["loss_mask"])


@pytest.mark.slow
def test_chat_rendering_per_turn_reaches_the_rows_through_the_command_line(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from dflash import cli
    from tests.dflash.hf_fixtures import save_hf_target

    target = save_hf_target(tmp_path / "t")
    chats = tmp_path / "chats.jsonl"
    messages = [
        {"role": "user", "content": "def add a b"},
        {"role": "assistant", "content": "return a"},
        {"role": "user", "content": "print x"},
        {"role": "assistant", "content": "print y"},
    ]
    chats.write_text(json.dumps({"messages": messages}) + "\n")

    def documents(rendering: str) -> list[dict]:
        out = tmp_path / f"{rendering}.json"
        args = [
            "inspect-data",
            "--target",
            str(target),
            "--data",
            str(chats),
            "--seq-len",
            "64",
            "--json",
            str(out),
            "--chat-rendering",
            rendering,
        ]
        result = CliRunner().invoke(cli.cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())

    (whole,) = documents("whole")
    first, second = documents("per-turn")
    assert whole["text"].count("def add a b") == 1
    assert first["text"].rstrip().endswith("assistant return a </s>")
    assert "print y" not in first["text"] and second["text"].count("return a") == 1
    assert sum(first["loss_mask"]) + sum(second["loss_mask"]) == sum(whole["loss_mask"])
