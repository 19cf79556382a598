"""Tiny Qwen3 and Llama targets made with transformers, saved like hub models."""

from pathlib import Path

import torch

WORDS = "user assistant def add a b return for i in range print x y z if else while".split()
SPARE_ROWS = 16


def save_word_tokenizer(directory: Path):
    """A word-level tokenizer with a chat template and EOS, no mask token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "<s>", "</s>"])
    raw.train_from_iterator([" ".join(WORDS)], trainer)
    specials = dict(unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>", eos_token="</s>")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, **specials)
    tok.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant {% endif %}"
    )
    tok.save_pretrained(directory)
    return tok


# Both transformers targets: 4 layers, hidden 64 and heads of 32.
_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, head_dim=32)


def qwen3_config(vocab_size: int, **overrides):
    """head_dim 32 with hidden 64 and 4 heads (head_dim != hidden/heads), 2 KV heads."""
    from transformers import Qwen3Config

    kwargs = dict(vocab_size=vocab_size, **_SHAPE, num_attention_heads=4, num_key_value_heads=2)
    kwargs.update(max_position_embeddings=512, rms_norm_eps=1e-5)
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    return Qwen3Config(**{**kwargs, **overrides})


def llama3_config(vocab_size: int, **overrides):
    """Llama with GQA, head_dim != hidden/heads and a `llama3` rope scaling."""
    from transformers import LlamaConfig

    scaling = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}
    scaling |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    kwargs = dict(vocab_size=vocab_size, **_SHAPE, num_attention_heads=4, num_key_value_heads=1)
    kwargs.update(max_position_embeddings=1024, rope_parameters=scaling, attention_bias=True)
    return LlamaConfig(**{**kwargs, **overrides})


def save_hf_target(directory: Path, arch: str = "qwen3", spare_rows: int = SPARE_ROWS) -> Path:
    """A randomly initialized tiny target of `arch` ('qwen3' | 'llama') with spare rows."""
    from transformers import AutoModelForCausalLM

    tok = save_word_tokenizer(directory)
    make = qwen3_config if arch == "qwen3" else llama3_config
    config = make(len(tok) + spare_rows, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def save_tiny_hf_model(directory) -> None:
    """A 4-layer Llama with a byte-level BPE tokenizer and a chat template, built here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=alphabet
    )
    raw.train_from_iterator(["def f(x):\n    return x + 1\n" * 20, "hello there"], trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    tok.save_pretrained(directory)
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    attention = dict(num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    ends = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = LlamaConfig(vocab_size=len(tok) + 8, **sizes, **attention, **ends)
    LlamaForCausalLM(config).save_pretrained(directory)
