"""`--drafter-init target`: the drafter starts as the target's last decoder layers."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dflash.cli import cli
from dflash.drafter.init import start_from_target, target_layers_copied
from dflash.drafter.model import DFlashDrafter, DrafterConfig, DrafterError
from dflash.target.load import load_target, wrap_tiny
from dflash.target.model import TargetModel
from dflash.target.tiny import TinyLM, TinyLMConfig
from tests.dflash.hf_fixtures import save_hf_target


def _drafter(target: TargetModel, layers: int, **kw: int) -> DFlashDrafter:
    cfg = DrafterConfig.for_target(target, num_layers=layers, block_size=4, **kw)
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head)


def test_the_last_layers_are_copied_in_order():
    assert target_layers_copied(2, 30) == [28, 29]
    with pytest.raises(DrafterError, match="only 3 to copy"):
        target_layers_copied(5, 3)


def test_the_tiny_targets_fused_projection_is_split_and_renamed():
    torch.manual_seed(0)
    cfg = TinyLMConfig(hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64)
    target = wrap_tiny(TinyLM(cfg))
    drafter = _drafter(target, 2)
    assert start_from_target(drafter, target) == [1, 2]
    for i, j in enumerate([1, 2]):
        theirs, ours = target.decoder_layers[j], drafter.layers[i]
        q, k, v = theirs.attn.qkv_proj.weight.chunk(3, dim=0)
        assert torch.equal(ours.self_attn.q_proj.weight, q)
        assert torch.equal(ours.self_attn.k_proj.weight, k)
        assert torch.equal(ours.self_attn.v_proj.weight, v)
        assert torch.equal(ours.self_attn.o_proj.weight, theirs.attn.o_proj.weight)
        assert torch.equal(ours.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(ours.input_layernorm.weight, theirs.input_norm.weight)
        assert torch.equal(ours.post_attention_layernorm.weight, theirs.post_attn_norm.weight)
    assert torch.equal(drafter.norm.weight, target.final_norm().weight)
    # The fusion passes the deepest captured layer through and nothing else.
    d, k = cfg.hidden_size, len(drafter.config.target_layer_ids)
    features = torch.randn(1, 5, k * d)
    assert torch.equal(drafter.fc(features), features[..., (k - 1) * d :])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_head_only_target_gives_the_weights_the_whole_one_does(tmp_path, arch):
    directory = save_hf_target(tmp_path / arch, arch)
    whole, head = load_target(str(directory)), load_target(str(directory), head_only=True)
    a, b = _drafter(whole, 1), _drafter(head, 1)
    assert start_from_target(a, whole) == start_from_target(b, head) == [whole.num_layers - 1]
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    last = whole.decoder_layers[-1]
    assert torch.equal(a.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    if arch == "qwen3":  # its q/k norms are the drafter's too
        assert torch.equal(a.layers[0].self_attn.q_norm.weight, last.self_attn.q_norm.weight)


def test_another_ffn_width_is_one_line(tmp_path):
    directory = save_hf_target(tmp_path / "t", "llama")
    target = load_target(str(directory))
    drafter = _drafter(target, 1, intermediate_size=8)
    with pytest.raises(DrafterError, match="leave --drafter-intermediate-size unset"):
        start_from_target(drafter, target)


def test_train_starts_from_the_target_and_refuses_a_second_start(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--steps", "2", "--drafter-init", "target", "--output-dir", str(out)]
    args += "--eval-prompts 0 --trace-level off --seq-len 32 --batch-size 2".split()
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "drafter: starts as the target's layer 5 (of 6)" in result.output
    assert json.loads((out / "config.json").read_text())["drafter"]["init"] == "target"
    again = ["train", "--drafter-init", "target", "--init-from", str(out / "drafter")]
    bad = CliRunner().invoke(cli, [*again, "--output-dir", str(tmp_path / "b")])
    assert bad.exit_code == 2 and bad.output.count("Error:") == 1, bad.output
    assert "both say where the drafter starts" in bad.output
