"""A saved drafter through speculators' own DFlash converter, with its target as the
verifier: the route into speculators' format (docs/serving.md, "Serving a trained drafter").

speculators pins older torch and transformers than this project, so it is not in the
project's environment: scripts/speculators_check.sh runs this file in a venv that adds
speculators (without its pins) to the project's dependencies; elsewhere it is skipped.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.drafter.io import save_drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.target.load import load_target
from tests.dflash.hf_fixtures import save_hf_target

speculators = pytest.importorskip(
    "speculators", reason="speculators is not installed (scripts/speculators_check.sh runs this)"
)


def test_speculators_converts_a_saved_drafter_bit_exactly(tmp_path):
    from speculators.convert.dflash import DFlashConverter
    from speculators.models.dflash import DFlashDraftModel

    target_dir = save_hf_target(tmp_path / "target", "qwen3")
    target = load_target(str(target_dir))
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 2])
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    with torch.no_grad():  # norms start at 1: make them differ so every name is checked
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    save_drafter(drafter, tmp_path / "drafter", dtype=torch.bfloat16)

    out = tmp_path / "speculators"
    DFlashConverter().convert(tmp_path / "drafter", out, base_model=str(target_dir), validate=True)

    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["block_size"] == 4 and config["mask_token_id"] == cfg.mask_token_id
    # speculators counts the embedding output as layer 0: our layer i is its i + 1.
    assert config["aux_hidden_state_layer_ids"] == [1, 3]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    ours = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    model = DFlashDraftModel.from_pretrained(str(out))
    theirs = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    # The verifier's parts it filled in are the target's own.
    assert torch.equal(theirs["embed_tokens.weight"], target.embed_tokens.weight.to(torch.bfloat16))


def test_speculators_reads_the_files_cache_hidden_writes(tmp_path, monkeypatch):
    """`cache-hidden --format speculators`: speculators' own check and its training
    dataset accept the files, and they train here from its Arrow dataset's loss masks."""
    from click.testing import CliRunner
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    from dflash.cli import cli
    from dflash.target import load as target_load
    from tests.dflash.app_fixtures import _small_target_loader, write_corpus

    monkeypatch.setattr(target_load, "load_target", _small_target_loader(target_load.load_target))
    sizes = "--seq-len 32 --batch-size 2 --drafter-layers 1".split()
    opts = ["--data", str(write_corpus(tmp_path)), *sizes]
    cache = tmp_path / "cache"
    args = ["cache-hidden", "--format", "speculators", "--output", str(cache), *opts]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    files = sorted((cache / "hidden_states").glob("hs_*.safetensors"))
    for path in files:
        sample = load_file(str(path))
        check_hidden_states(sample, sample["token_ids"].tolist())
    dataset = ArrowDataset(
        max_len=32, datapath=str(cache), on_missing="raise", hidden_states_dtype=torch.float32
    )
    assert len(dataset) == len(files)
    item, ours = dataset[2], load_file(str(cache / "hidden_states" / "hs_2.safetensors"))
    assert torch.equal(item["hidden_states"], ours["hidden_states"][:, :-1].flatten(1))
    assert torch.equal(item["verifier_last_hidden_states"], ours["hidden_states"][:, -1])
    assert torch.equal(torch.as_tensor(item["loss_mask"]).bool(), ours["loss_mask"])
    # As speculators' vLLM generation leaves them: the loss masks only in the Arrow dataset.
    (cache / "dflash_samples.json").unlink()
    for path in files:
        sample = load_file(str(path))
        save_file({k: v for k, v in sample.items() if k != "loss_mask"}, str(path))
    run_dir = tmp_path / "run"
    flags = "--target-layers 3 --steps 3 --block-size 4 --eval-prompts 0".split()
    args = ["train", "--hidden-cache", str(cache), *opts, *flags, "--output-dir", str(run_dir)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "speculators' layout" in result.output
