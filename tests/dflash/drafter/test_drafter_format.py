"""The saved drafter against the written spec (docs/drafter-format.md), reload, export,
warm start."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from dflash.drafter.io import (
    export_drafter,
    init_drafter_from,
    load_drafter,
    read_drafter_config,
    save_drafter,
)
from dflash.drafter.model import DFlashDrafter, DrafterConfig, DrafterError
from dflash.target.load import load_target, wrap_tiny
from dflash.target.model import TargetModel
from dflash.target.tiny import TinyLM, TinyLMConfig
from tests.dflash.app_fixtures import cpu_run, small_cfg, tiny_target  # noqa: F401
from tests.dflash.hf_fixtures import save_hf_target

SPEC = Path(__file__).resolve().parents[3] / "docs" / "drafter-format.md"


def spec_block(name: str) -> list[list[str]]:
    """Rows (whitespace-split, first two columns) of the ```text block after a spec marker."""
    text = SPEC.read_text()
    block = re.search(rf"<!-- spec:{name} -->\n```text\n(.*?)```", text, re.S)
    assert block, f"no spec:{name} block in {SPEC}"
    return [line.split(None, 1) for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> TargetModel:
    return load_target(str(save_hf_target(tmp_path_factory.mktemp("qwen3"), "qwen3")))


def make_drafter(target: TargetModel, seed: int = 1, layers: int = 2) -> DFlashDrafter:
    cfg = DrafterConfig.for_target(target, num_layers=layers, block_size=4)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    with torch.no_grad():  # norms start at 1: make them differ so names are really checked
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return drafter


def logits_of(target: TargetModel, drafter: DFlashDrafter) -> torch.Tensor:
    ids = torch.randint(0, 20, (1, 16), generator=torch.Generator().manual_seed(0))
    hidden = target.capture(ids, drafter.config.target_layer_ids, with_logits=False).hidden
    anchors, keep = torch.tensor([[2, 7, 11]]), torch.ones(1, 3, dtype=torch.bool)
    blocks = torch.full((1, 3, 4), drafter.mask_id)
    blocks[0, :, 0] = ids[0, anchors[0]]
    return drafter(hidden, blocks, anchors, keep)


def _shape(expr: str, env: dict[str, int]) -> tuple[int, ...]:
    dims = expr.strip("[]").split(",")
    return tuple(eval(d.strip(), {}, dict(env)) for d in dims)  # noqa: S307 - the spec's own text


@pytest.mark.slow
def test_saved_qwen3_drafter_matches_the_spec_and_reloads_bit_identically(qwen3, tmp_path):
    from safetensors.torch import load_file

    drafter = make_drafter(qwen3)
    out = save_drafter(drafter, tmp_path / "drafter", training_config={"steps": 1})
    # Readable by all: an engine that serves it may run as another user.
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "dflash_train.json": 0o644}
    config = json.loads((out / "config.json").read_text())
    assert set(config) == {row[0] for row in spec_block("config-keys")}
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert (config["head_dim"], config["num_key_value_heads"]) == (32, 2)
    assert config["rope_theta"] == 1e6 and config["rope_parameters"]["rope_theta"] == 1e6
    assert config["num_target_layers"] == 4 and config["block_size"] == 4
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert config["torch_dtype"] == "float32"
    weights = load_file(str(out / "model.safetensors"))
    c = config
    env = {"D": c["hidden_size"], "K": len(c["dflash_config"]["target_layer_ids"])}
    env |= {"Hq": c["num_attention_heads"], "Hkv": c["num_key_value_heads"]}
    env |= {"Hd": c["head_dim"], "I": c["intermediate_size"]}
    expected = {}
    for pattern, shape in spec_block("weights"):
        for n in range(c["num_hidden_layers"]) if "{N}" in pattern else [None]:
            expected[pattern.replace("{N}", str(n))] = _shape(shape, env)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert all(v.dtype == torch.float32 for v in weights.values())
    meta = json.loads((out / "dflash_train.json").read_text())
    assert meta["training_config"] == {"steps": 1} and "torch" in meta["versions"]

    loaded, _ = load_drafter(out, target=qwen3)
    assert torch.equal(logits_of(qwen3, loaded), logits_of(qwen3, drafter))


@pytest.mark.slow
def test_transformers_reads_the_saved_config_with_the_same_rope(qwen3, tmp_path) -> None:
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    drafter = make_drafter(qwen3)
    out = save_drafter(drafter, tmp_path / "d")
    hf = AutoConfig.from_pretrained(out)
    assert (hf.head_dim, hf.num_key_value_heads, hf.num_hidden_layers) == (32, 2, 2)
    positions = torch.tensor([[0, 3, 100, 400]])
    cos, _ = Qwen3RotaryEmbedding(hf)(torch.zeros(1, 4, 32), positions)
    assert torch.allclose(cos, drafter.rope(positions)[0], atol=1e-6)


def _tiny_target(num_layers: int) -> TargetModel:
    torch.manual_seed(0)
    config = TinyLMConfig(hidden_size=32, num_layers=num_layers, num_heads=2, intermediate_size=64)
    return wrap_tiny(TinyLM(config))


@pytest.fixture(scope="module")
def small() -> TargetModel:
    return _tiny_target(6)


def test_not_a_dflash_checkpoint_and_mismatches_are_one_line_errors(small, tmp_path) -> None:
    with pytest.raises(DrafterError, match="is not a DFlash checkpoint"):
        read_drafter_config(tmp_path)
    drafter = make_drafter(small)
    out = save_drafter(drafter, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DrafterError, match=r"architectures is \['LlamaForCausalLM'\]"):
        read_drafter_config(out)
    (out / "config.json").write_text(json.dumps(config))
    deeper = make_drafter(small, layers=3)
    with pytest.raises(DrafterError, match="checkpoint has num_layers=2, this run 3"):
        init_drafter_from(deeper, out)
    other = _tiny_target(8)
    with pytest.raises(DrafterError, match="num_target_layers is 6, the target .* has 8"):
        load_drafter(out, target=other)


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        ([3, 1], r"target_layer_ids \[3, 1\]: ids must be ascending"),
        ([1, 1], r"target_layer_ids \[1, 1\]: layer 1 is named twice"),
    ],
)
def test_a_saved_drafter_with_layers_no_engine_reads_so_is_refused(small, tmp_path, ids, fragment):
    out = save_drafter(make_drafter(small), tmp_path / "d")
    assert read_drafter_config(out).target_layer_ids == [1, 3]
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = ids
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match=fragment) as info:
        read_drafter_config(out)
    assert "\n" not in str(info.value) and str(out / "config.json") in str(info.value)
    with pytest.raises(DrafterError, match=fragment):
        load_drafter(out, target=small)


def test_export_converts_the_first_layout(small, tmp_path) -> None:
    from safetensors.torch import save_file

    drafter = make_drafter(small)
    old_names = {
        "hidden_norm.": "fc_norm.",
        ".input_layernorm.": ".input_norm.",
        ".post_attention_layernorm.": ".post_attn_norm.",
        ".self_attn.": ".attn.",
    }
    state = {}
    for name, tensor in drafter.state_dict().items():
        for new, old in old_names.items():
            name = name.replace(new, old)
        state[name] = tensor.contiguous()
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    save_file(state, str(old_dir / "model.safetensors"))
    c = drafter.config
    old_cfg = dict(hidden_size=32, num_layers=2, num_heads=2, head_dim=16, intermediate_size=64)
    old_cfg.update(block_size=4, target_layer_ids=c.target_layer_ids)
    old_cfg.update(mask_token_id=c.mask_token_id, vocab_size=c.vocab_size)
    old_cfg.update(target_spec="builtin:tiny", num_kv_heads=2, rope_theta=10000.0, rms_eps=1e-6)
    (old_dir / "config.json").write_text(json.dumps(old_cfg))
    with pytest.raises(DrafterError, match="older dflash-train drafter"):
        read_drafter_config(old_dir)
    new_dir = export_drafter(old_dir, tmp_path / "new", num_target_layers=6)
    loaded, _ = load_drafter(new_dir, target=small)
    assert torch.equal(logits_of(small, loaded), logits_of(small, drafter))
    with pytest.raises(DrafterError, match="already a DFlash checkpoint"):
        export_drafter(new_dir, tmp_path / "again")

    from click.testing import CliRunner

    from dflash.cli import cli

    def export(src, dst):
        args = ["export", "--drafter", str(src), "--output", str(dst), "--num-target-layers", "6"]
        return CliRunner().invoke(cli, args, catch_exceptions=False)

    result = export(old_dir, tmp_path / "cli")
    assert result.exit_code == 0 and result.output.strip() == str(tmp_path / "cli")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "cli" / name).read_bytes() == (new_dir / name).read_bytes()
    result = export(new_dir, tmp_path / "again")
    assert result.exit_code == 2 and "already a DFlash checkpoint" in result.output
    assert len(result.output.strip().splitlines()) == 1

    # Damaged old folders: one line each, naming what is wrong.
    def config_json(value):  # the damage: config.json holds `value`
        return lambda d: (d / "config.json").write_text(json.dumps(value))

    def layer_ids(ids):
        return config_json({**old_cfg, "target_layer_ids": ids})

    def truncated(d):
        weights = d / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])

    damages = {
        "a list as config.json": (config_json([1, 2]), "not a drafter config"),
        "target_layer_ids null": (layer_ids(None), "unusable value"),
        "truncated weights": (truncated, "damaged"),
        "layers out of order": (layer_ids([3, 1]), "ids must be ascending"),
        "a layer twice": (layer_ids([3, 3]), "layer 3 is named twice"),
    }
    for name, (damage, fragment) in damages.items():
        broken = tmp_path / name.replace(" ", "-")
        shutil.copytree(old_dir, broken)
        damage(broken)
        result = export(broken, tmp_path / f"{broken.name}-out")
        assert result.exit_code == 2 and fragment in result.output, (name, result.output)
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
        assert not (tmp_path / f"{broken.name}-out" / "config.json").exists()

    # The target's last layer (5 of 6): exported, with one warning on stderr naming the engines.
    last = tmp_path / "last-layer"
    shutil.copytree(old_dir, last)
    (last / "config.json").write_text(json.dumps({**old_cfg, "target_layer_ids": [1, 5]}))
    result = export(last, tmp_path / "last-out")
    assert result.exit_code == 0 and result.stdout.strip() == str(tmp_path / "last-out")
    (warning,) = result.stderr.strip().splitlines()
    assert "target layer 5" in warning and "SGLang" in warning and "speculators" in warning
    assert read_drafter_config(tmp_path / "last-out").target_layer_ids == [1, 5]
    assert export(old_dir, tmp_path / "cli-again").stderr == ""  # layers 1, 3: nothing to say


def _step_loss(run, index: int) -> torch.Tensor:
    """One real trainer step on batch `index` (document-aware capture); its loss."""
    batch = run.train_data.batch(index)
    out = run.target.capture(
        batch.input_ids, run.layer_ids, with_logits=False, doc_ids=batch.doc_ids
    )
    return run.trainer.step(batch, out).loss


@pytest.mark.usefixtures("tiny_target")
def test_init_from_continues_with_the_uninterrupted_loss(tmp_path) -> None:
    straight = cpu_run(small_cfg(tmp_path, tmp_path / "a", seed=3))
    _step_loss(straight, 0)
    save_drafter(straight.drafter, tmp_path / "after-one-step")
    expected = _step_loss(straight, 1)
    # Same config (same batches and anchors); only the drafter starts from the saved one.
    fresh = cpu_run(small_cfg(tmp_path, tmp_path / "b", seed=3))
    assert not torch.equal(fresh.drafter.fc.weight, straight.drafter.fc.weight)
    warm = cpu_run(
        small_cfg(tmp_path, tmp_path / "c", seed=3, init_from=str(tmp_path / "after-one-step"))
    )
    assert warm.initialized_from == tmp_path / "after-one-step"
    assert torch.equal(_step_loss(warm, 1), expected)
