import json
from pathlib import Path

import pytest
import torch

from dflash.data.tokenizer import MASK_ID
from dflash.target.geometry import TargetError
from dflash.target.load import load_target, wrap_tiny
from dflash.target.model import (
    TargetModel,
    default_target_layers,
    last_layer_warning,
    validate_target_layers,
)
from dflash.target.tiny import TinyLM, TinyLMConfig, cache_key, prepare_builtin_target

SMALL_LM = TinyLMConfig(hidden_size=32, num_layers=6, num_heads=2, intermediate_size=64)
CORPUS = ["def add(a, b): return a + b", "for i in range(10): print(i)", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    torch.manual_seed(0)
    return wrap_tiny(TinyLM(SMALL_LM))


def test_default_layers_spread_from_1_to_l_minus_3() -> None:
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, from the paper
    assert default_target_layers(6, 3) == [1, 2, 3]
    assert default_target_layers(28, 1) == [13]
    # The built-in tiny target (6 layers) with the default one drafter layer.
    assert default_target_layers(TinyLMConfig().num_layers, 1) == [2]


def test_default_layers_on_a_shallow_target_widen_the_range_and_never_repeat() -> None:
    assert default_target_layers(4, 2) == [1, 2]  # was [1, 1]: up to L-2 first
    assert default_target_layers(6, 4) == [1, 2, 3, 4]  # was [1, 2, 2, 3]
    assert default_target_layers(6, 5) == [0, 1, 2, 3, 4]  # then down to layer 0
    assert default_target_layers(2, 2) == [0, 1]  # the last layer only when nothing else fits
    for num_layers in range(1, 40):
        for k in range(1, num_layers + 1):
            ids = default_target_layers(num_layers, k)
            assert ids == sorted(set(ids)) and len(ids) == k and 0 <= ids[0] <= ids[-1] < num_layers


def test_more_drafter_layers_than_target_layers_is_one_line() -> None:
    with pytest.raises(TargetError, match="--drafter-layers 5: .* only 4 distinct") as info:
        default_target_layers(4, 5)
    assert "\n" not in str(info.value) and "--target-layers" in str(info.value)


def test_layer_ids_out_of_range_name_the_id() -> None:
    validate_target_layers([0, 5], 6)
    with pytest.raises(TargetError, match="target layer id 6 is out of range"):
        validate_target_layers([1, 6], 6)
    with pytest.raises(TargetError, match="-1"):
        validate_target_layers([-1], 6)


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [([3, 1], "must be ascending"), ([1, 3, 1], "layer 1 is named twice")],
)
def test_layer_ids_out_of_order_or_repeated_are_refused_with_the_fix(ids, fragment) -> None:
    with pytest.raises(TargetError, match=fragment) as info:
        validate_target_layers(ids, 6)
    assert "vLLM and SGLang" in str(info.value) and str(info.value).endswith("(give 1,3)")


def test_the_last_layer_is_warned_about_naming_the_engines() -> None:
    assert last_layer_warning([1, 4], 6) is None
    warning = last_layer_warning([1, 5], 6)
    assert warning is not None and "\n" not in warning
    for name in ("layer 5", "vLLM", "SGLang", "speculators"):
        assert name in warning


def _manual_layer_outputs(model: TinyLM, ids: torch.Tensor) -> list[torch.Tensor]:
    from dflash.nn.layers import rope_cos_sin

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    rope = rope_cos_sin(pos, model.config.head_dim, model.config.rope_theta)
    x, outs = model.embed_tokens(ids), []
    for layer in model.layers:
        x = layer(x, rope)
        outs.append(x)
    return outs


def test_capture_returns_the_chosen_layers_in_order(tiny: TargetModel) -> None:
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    out = tiny.capture(ids, [3, 1], with_logits=True)
    ref = _manual_layer_outputs(tiny.model, ids)
    assert out.hidden.shape == (2, 12, 2 * 32)
    assert torch.allclose(out.hidden, torch.cat([ref[3], ref[1]], -1), atol=1e-5)
    assert torch.allclose(out.logits, tiny.logits(ids))


def test_capture_without_logits_stops_after_the_last_needed_layer(tiny: TargetModel) -> None:
    calls: list[int] = []
    handles = [
        layer.register_forward_hook(lambda *_a, i=i: calls.append(i))
        for i, layer in enumerate(tiny.model.layers)
    ]
    try:
        out = tiny.capture(torch.zeros(1, 5, dtype=torch.long), [1, 2], with_logits=False)
    finally:
        for h in handles:
            h.remove()
    assert out.logits is None
    assert calls == [0, 1, 2]  # layers 3..5 never ran


def test_target_is_frozen_and_stays_in_eval_mode(tiny: TargetModel) -> None:
    tiny.train()
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.parameters())
    assert tiny.mask_token().token_id == MASK_ID and tiny.num_layers == 6


def test_bad_target_specs_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="does not exist: /no/such/model"):
        load_target("/no/such/model")
    with pytest.raises(TargetError, match="no config.json"):
        load_target(str(tmp_path))
    with pytest.raises(TargetError, match="builtin:'huge'"):
        load_target("builtin:huge")


@pytest.mark.slow
def test_a_directory_that_is_not_a_causal_lm_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(TargetError, match="is not a causal LM"):
        load_target(str(tmp_path))


def save_hf_model(directory: Path, num_layers: int = 6, with_mask: bool = False) -> Path:
    """A tiny Llama and a word-level tokenizer with a chat template, saved like a hub model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["[UNK]", "[PAD]", "<s>", "</s>"] + (["[MASK]"] * with_mask)
    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=specials))
    named = dict(unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>", eos_token="</s>")
    if with_mask:
        named["mask_token"] = "[MASK]"
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, **named)
    tok.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    )
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers)
    attention = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg = LlamaConfig(vocab_size=len(tok), **sizes, **attention)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_hf_target_capture_drafter_and_training_end_to_end(tmp_path: Path) -> None:
    from dflash.config.settings import LossConfig
    from dflash.drafter.io import load_drafter, save_drafter
    from dflash.drafter.model import DFlashDrafter, DrafterConfig
    from dflash.objective.blocks import block_labels, build_blocks, select_anchors
    from dflash.objective.reference import dflash_loss

    target = load_target(str(save_hf_model(tmp_path / "llama")))
    assert target.num_layers == 6 and target.hidden_size == 32
    # No mask token, no spare row: the tokenizer fills the embedding exactly.
    with pytest.raises(TargetError, match="give --mask-token-id"):
        target.mask_token()
    ids = torch.tensor([target.tokenizer.encode(" ".join(CORPUS))])  # [1, T]
    ref = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    out = target.capture(ids, [1, 3], with_logits=False)
    # hidden_states[i + 1] is decoder layer i's output (index 0 is the embedding).
    assert torch.allclose(out.hidden, torch.cat([ref[2], ref[4]], -1), atol=1e-5)
    assert out.logits is None
    with pytest.raises(TargetError, match="out of range"):
        target.capture(ids, [6], with_logits=False)

    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=4, mask_token_id=1)
    assert cfg.target_layer_ids == [1, 3] and cfg.num_heads == 4 and cfg.num_kv_heads == 2
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors, keep = select_anchors(loss_mask, 8, torch.Generator().manual_seed(0))
    blocks = build_blocks(ids, anchors, 4, drafter.mask_id)
    labels, valid = block_labels(ids, loss_mask, anchors, keep, 4)
    hidden = target.capture(ids, cfg.target_layer_ids, with_logits=False).hidden
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = dflash_loss(drafter(hidden, blocks, anchors, keep), labels, valid, LossConfig()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]

    save_drafter(drafter, tmp_path / "drafter")
    loaded, loaded_target = load_drafter(tmp_path / "drafter")  # finds its target by spec
    assert loaded_target.spec == str(tmp_path / "llama")
    assert torch.equal(
        loaded(hidden, blocks, anchors, keep), drafter(hidden, blocks, anchors, keep)
    )


@pytest.mark.slow
def test_hf_mask_token_with_an_embedding_row_is_used(tmp_path: Path) -> None:
    target = load_target(str(save_hf_model(tmp_path / "m", num_layers=2, with_mask=True)))
    mask = target.mask_token()
    assert mask.token_id == target.tokenizer.mask_token_id is not None
    assert mask.source == "tokenizer"
    assert target.num_layers == 2 and default_target_layers(2, 1) == [1]


def test_tiny_cache_key_depends_on_seed_and_arch() -> None:
    from dflash.target.tiny import TinyRecipe

    base = cache_key(TinyLMConfig(), TinyRecipe(), 0)
    assert base == cache_key(TinyLMConfig(), TinyRecipe(), 0)
    assert base != cache_key(TinyLMConfig(), TinyRecipe(), 1)
    assert base != cache_key(SMALL_LM, TinyRecipe(), 0)


def test_builtin_tiny_is_the_shipped_weights(tmp_path: Path, monkeypatch) -> None:
    """A fresh machine trains no target: the default recipe's weights ship in the
    repository, so every machine decodes with the same ones (and the first run is the
    drafter's)."""
    from dataclasses import asdict

    from dflash.files import sha256_file
    from dflash.target import tiny

    def no_training(*_args, **_kwargs):
        raise AssertionError("the default tiny target must not be trained")

    monkeypatch.setattr(tiny, "train_tiny_lm", no_training)
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    path = prepare_builtin_target(log=no_training)
    assert path == tiny.SHIPPED_DIR
    assert sha256_file(path / "model.safetensors") == tiny.SHIPPED_SHA256
    meta = json.loads((path / "config.json").read_text())
    assert meta["arch"] == asdict(TinyLMConfig()) and meta["recipe"] == asdict(tiny.TinyRecipe())
    model = tiny.load_tiny_lm(path)  # stored in bfloat16, loaded as float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not list(tmp_path.iterdir())  # nothing written to the cache


def test_missing_or_changed_shipped_weights_are_one_line(tmp_path: Path) -> None:
    import shutil

    from dflash.target import tiny

    copy = tmp_path / "tiny"
    shutil.copytree(tiny.SHIPPED_DIR, copy)
    assert tiny.shipped_target(copy) == copy
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(TargetError, match="not the shipped file") as err:
        tiny.shipped_target(copy)
    assert "\n" not in str(err.value) and "scripts/train_tiny_target.py" in str(err.value)
    weights.unlink()
    with pytest.raises(TargetError, match="are missing"):
        tiny.shipped_target(copy)


@pytest.mark.slow
def test_prepare_builtin_target_caches_atomically(tmp_path: Path) -> None:
    """A few-step recipe: exercises the train-save-rename path and the cache hit."""
    from dflash.target.tiny import TinyRecipe, load_tiny_lm

    recipe = TinyRecipe(steps=2, batch_size=2, seq_len=16, eval_batches=1)
    lines: list[str] = []
    path = prepare_builtin_target(tmp_path, seed=0, log=lines.append, cfg=SMALL_LM, recipe=recipe)
    assert path.parent == tmp_path / "targets" and (path / "model.safetensors").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp")]
    assert any("held-out loss" in line for line in lines)
    again: list[str] = []
    assert prepare_builtin_target(tmp_path, 0, again.append, SMALL_LM, recipe) == path
    assert again == []  # cache hit: no training
    assert load_tiny_lm(path).config == SMALL_LM
