"""The mask token of last resort: a tokenizer whose only special tokens are BOS, EOS or
padding, UNK and the chat markers the data uses (Llama-2, Mistral-7B-v0.1, TinyLlama)
masks with UNK when the data never holds it, and says why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash.target.model import unused_special_token
from tests.dflash.hf_fixtures import WORDS, qwen3_config, save_word_tokenizer

pytest.importorskip("transformers")


@pytest.fixture
def tokenizer(tmp_path: Path):
    """Special tokens [UNK] 0, [PAD] 1, <s> 2, </s> 3 and nothing else; no spare row."""
    return save_word_tokenizer(tmp_path / "tokenizer")


def data_of(tokenizer, words: str) -> list[np.ndarray]:
    ids = tokenizer(words)["input_ids"]
    return [
        np.array([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id, tokenizer.pad_token_id])
    ]


def test_unk_is_taken_when_no_other_special_token_is_free_and_the_data_lacks_it(
    tokenizer,
) -> None:
    chosen = unused_special_token(tokenizer, len(tokenizer), data_of(tokenizer, "def add a b"))
    assert chosen is not None
    assert (chosen.token_id, chosen.source, chosen.text) == (0, "unused-unk", "[UNK]")
    assert chosen.describe().startswith("mask token id 0 ('[UNK]', the unknown token: ")
    assert "occurs in neither the training nor the held-out data" in chosen.describe()


def test_unk_in_the_data_is_refused_as_before(tokenizer) -> None:
    with_unk = data_of(tokenizer, "add unknownword")  # a word outside the vocabulary
    assert (with_unk[0] == tokenizer.unk_token_id).any()
    assert unused_special_token(tokenizer, len(tokenizer), with_unk) is None


def test_unk_that_pads_is_never_taken(tokenizer) -> None:
    old_pad = tokenizer.pad_token_id  # used by the data: no other special token is free
    tokenizer.pad_token = "[UNK]"  # as Llama-2 set-ups often do: the pipeline writes it
    words = tokenizer("def add")["input_ids"]
    data = [np.array([tokenizer.bos_token_id, *words, tokenizer.eos_token_id, old_pad])]
    assert not (data[0] == tokenizer.unk_token_id).any()  # only padding could write it
    assert tokenizer.pad_token_id == tokenizer.unk_token_id
    assert unused_special_token(tokenizer, len(tokenizer), data) is None


def test_a_free_special_token_still_comes_before_unk(tokenizer) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": ["<reserved_0>"]})
    chosen = unused_special_token(tokenizer, len(tokenizer), data_of(tokenizer, "def add"))
    assert chosen is not None and (chosen.text, chosen.source) == ("<reserved_0>", "unused-special")


@pytest.mark.slow  # builds and trains a small transformers model
def test_a_target_with_bos_eos_unk_only_trains_with_unk_as_its_mask(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from dflash.cli import cli

    target_dir = tmp_path / "target"
    tok = save_word_tokenizer(target_dir)
    torch.manual_seed(0)
    config = qwen3_config(len(tok), eos_token_id=tok.eos_token_id)  # no spare row
    AutoModelForCausalLM.from_config(config).save_pretrained(target_dir)
    chats = tmp_path / "chats.jsonl"
    reply = {"role": "assistant", "content": " ".join(WORDS[2:])}
    questions = [{"role": "user", "content": f"print {word}"} for word in WORDS]
    chats.write_text("".join(json.dumps({"messages": [q, reply]}) + "\n" for q in questions * 2))
    out = tmp_path / "run"
    args = ["train", "--target", str(target_dir), "--data", str(chats), "--output-dir", str(out)]
    small = "--steps 2 --batch-size 2 --seq-len 64 --drafter-layers 1 --block-size 4"
    args += [*small.split(), "--num-anchors", "4", "--eval-prompts", "0"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("mask token")]
    assert line.startswith("mask token id 0 ('[UNK]', the unknown token: "), line
    saved = json.loads((out / "drafter" / "config.json").read_text())
    assert saved["dflash_config"]["mask_token_id"] == 0
