"""The trainer's drafter options end to end: the mask token, --init-from, the noise
schedule, packing, the DFlash directory it saves, and document isolation in the step."""

import copy
import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from dflash import cli as cli_mod
from dflash.data.datasets import Batch
from dflash.data.documents import document_positions
from dflash.data.tokenizer import BOS_ID, EOS_ID, MASK_ID, ByteTokenizer
from dflash.drafter.io import read_drafter_config, save_drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.objective.blocks import block_labels, build_blocks, select_anchors
from dflash.objective.noise import NoiseSchedule
from dflash.objective.reference import dflash_loss
from dflash.run.finish import save_run_checkpoint
from dflash.run.target_features import capture_fn
from dflash.target import load as target_mod
from dflash.target.tiny import TinyLM
from dflash.train.step import DrafterTrainer, anchor_seed
from tests.dflash.app_fixtures import SMALL_LM, cpu_run, small_cfg, small_options, tiny_target  # noqa: F401


def invoke(args):
    return CliRunner().invoke(cli_mod.cli, args, catch_exceptions=False)


def train_args(tmp_path, **extra):
    args = ["train"]
    for key, value in {**small_options(tmp_path), "steps": 2, **extra}.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture
def target_rows(monkeypatch):
    """set(vocab_size, tokenizer_mask): the built-in target becomes a small LM with that
    many embedding rows and a byte tokenizer with that mask token (None: none)."""
    loads = []

    def use(vocab_size: int, tokenizer_mask: int | None) -> list[str]:
        def load(spec, device="cpu", dtype=None, log=print, head_only=False):
            loads.append(spec)
            torch.manual_seed(123)
            lm = TinyLM(dataclasses.replace(SMALL_LM, vocab_size=vocab_size))
            target = target_mod.wrap_tiny(lm, spec=spec).to(device=device, dtype=dtype)
            target.tokenizer = ByteTokenizer(mask_token_id=tokenizer_mask)
            return target

        monkeypatch.setattr(target_mod, "load_target", load)
        return loads

    return use


def saved_drafter(tmp_path) -> tuple[dict, dict]:
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    meta = json.loads((tmp_path / "drafter" / "dflash_train.json").read_text())
    return config, meta


# ------------------------------------------------------------------ mask token


@pytest.mark.parametrize(
    ("vocab_size", "tokenizer_mask", "flag", "expected", "how"),
    [
        (260, MASK_ID, None, MASK_ID, "tokenizer"),
        (264, None, None, 260, "spare-row"),  # the first row past the tokenizer's 260
        (260, None, MASK_ID, MASK_ID, "explicit"),
    ],
)
def test_mask_token_is_resolved_printed_and_saved(
    tmp_path, target_rows, vocab_size, tokenizer_mask, flag, expected, how
) -> None:
    target_rows(vocab_size, tokenizer_mask)
    extra = {} if flag is None else {"mask_token_id": flag}
    result = invoke(train_args(tmp_path, **extra))
    assert result.exit_code == 0, result.output
    assert f"mask token id {expected} (" in result.output
    config, meta = saved_drafter(tmp_path)
    assert config["dflash_config"]["mask_token_id"] == expected
    assert meta["mask_token_source"] == how
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["mask_token_id"], summary["mask_token_source"]) == (expected, how)


def test_no_mask_token_and_no_spare_row_asks_for_mask_token_id(tmp_path, target_rows) -> None:
    target_rows(260, None)
    result = invoke(train_args(tmp_path))
    assert_one_line_error(result, "no mask token", "260 embedding rows", "--mask-token-id")


@pytest.mark.parametrize(
    ("mask_id", "fragments"),
    [
        (999, ["--mask-token-id 999", "out of range", "260 embedding rows"]),
        (ord("d"), [f"--mask-token-id {ord('d')}", "training data uses"]),
        (BOS_ID, [f"--mask-token-id {BOS_ID}", "training data uses"]),  # framing tokens too
        (EOS_ID, [f"--mask-token-id {EOS_ID}", "training data uses"]),
    ],
)
@pytest.mark.usefixtures("tiny_target")
def test_bad_mask_token_id_is_one_line_before_training(tmp_path, mask_id, fragments) -> None:
    assert_one_line_error(invoke(train_args(tmp_path, mask_token_id=mask_id)), *fragments)
    assert not (tmp_path / "drafter").exists()


# ------------------------------------------------------------------ --init-from


def drafter_for(tmp_path, name, lm_config=SMALL_LM, seed=7, **cfg_overrides) -> str:
    """A saved DFlash drafter of a small LM target (random weights)."""
    torch.manual_seed(seed)
    target = target_mod.wrap_tiny(TinyLM(lm_config))
    options = {"num_layers": 1, "block_size": 4, **cfg_overrides}
    drafter = DFlashDrafter(
        DrafterConfig.for_target(target, **options), target.embed_tokens, target.lm_head
    )
    return str(save_drafter(drafter, tmp_path / name))


@pytest.mark.usefixtures("tiny_target")
def test_init_from_bad_directories_are_one_line_errors(tmp_path, monkeypatch) -> None:
    (tmp_path / "empty").mkdir()
    assert_one_line_error(
        invoke(train_args(tmp_path, init_from=tmp_path / "empty")), "not a DFlash checkpoint"
    )
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (other / "model.safetensors").write_bytes(b"")
    assert_one_line_error(
        invoke(train_args(tmp_path, init_from=other)), "not a DFlash checkpoint", "LlamaForCausalLM"
    )
    wider = dataclasses.replace(SMALL_LM, hidden_size=48, num_heads=3)
    result = invoke(train_args(tmp_path, init_from=drafter_for(tmp_path, "wide", wider)))
    assert_one_line_error(result, "--init-from", "hidden_size is 48", "has 32")
    result = invoke(
        train_args(tmp_path, init_from=drafter_for(tmp_path, "layers", target_layer_ids=[2]))
    )
    assert_one_line_error(result, "target_layer_ids=[2]", "this run [1]", "--target-layers")
    result = invoke(
        train_args(tmp_path, init_from=drafter_for(tmp_path, "ffn", intermediate_size=48))
    )
    assert_one_line_error(result, "intermediate_size=48", "this run 64")


def test_init_from_with_other_drafter_flags_fails_before_the_target_loads(
    tmp_path, target_rows
) -> None:
    loads = target_rows(260, MASK_ID)
    source = drafter_for(tmp_path, "two", num_layers=2)
    result = invoke(train_args(tmp_path, init_from=source, drafter_layers=1))
    assert_one_line_error(result, "num_hidden_layers 2", "--drafter-layers 1")
    result = invoke(train_args(tmp_path, init_from=source, drafter_layers=2, mask_token_id=7))
    assert_one_line_error(result, f"mask_token_id {MASK_ID}", "--mask-token-id 7")
    assert loads == []


@pytest.mark.usefixtures("tiny_target")
def test_init_from_an_earlier_run_and_from_a_checkpoint(tmp_path) -> None:
    from safetensors.torch import load_file

    first = tmp_path / "first"
    assert invoke(train_args(tmp_path, output_dir=first, save_every=1)).exit_code == 0
    checkpoint_drafter = first / "checkpoints" / "step-00000002" / "drafter"
    # The last checkpoint's drafter/ is the final drafter: a servable DFlash directory.
    final = load_file(str(first / "drafter" / "model.safetensors"))
    in_checkpoint = load_file(str(checkpoint_drafter / "model.safetensors"))
    assert final.keys() == in_checkpoint.keys()
    assert all(torch.equal(final[k], in_checkpoint[k]) for k in final)
    assert read_drafter_config(checkpoint_drafter) == read_drafter_config(first / "drafter")
    for source in (first / "drafter", checkpoint_drafter):
        out = tmp_path / f"warm-{source.parent.name}"
        result = invoke(train_args(tmp_path, output_dir=out, init_from=source))
        assert result.exit_code == 0, result.output
        assert f"drafter initialized from {source}" in result.output
        assert saved_drafter(out)[1]["initialized_from"] == str(source)


@pytest.mark.usefixtures("tiny_target")
def test_resume_with_init_from_continues_the_checkpoint(tmp_path) -> None:
    """--resume wins: the checkpoint's weights already descend from the warm start, so a
    resumed run (even naming another --init-from) gives the uninterrupted losses."""
    start, other = drafter_for(tmp_path, "start"), drafter_for(tmp_path, "other", seed=8)
    full, part = [], []
    run_steps(small_cfg(tmp_path, tmp_path / "full", init_from=start), full)
    run_steps(small_cfg(tmp_path, tmp_path / "part", init_from=start), part, stop_at=3)
    resumed = small_cfg(tmp_path, tmp_path / "part", init_from=other, resume="latest")
    run = run_steps(resumed, part)
    assert run.initialized_from is None and run.resumed_from is not None
    assert len(full) == 6 and part == full
    # Not read at all: a restarted job resumes even when the warm-start folder is gone.
    gone = small_cfg(tmp_path, tmp_path / "part", init_from=str(tmp_path / "gone"), resume="latest")
    assert cpu_run(gone).step == 3  # the checkpoint run_steps wrote


def run_steps(cfg, sink, stop_at=None):
    run = cpu_run(cfg)
    while run.step < (stop_at or cfg.run.steps):
        batch = run.train_data.batch(run.next_batch_index)
        out = run.target.capture(
            batch.input_ids, run.layer_ids, with_logits=False, doc_ids=batch.doc_ids
        )
        sink.append(float(run.trainer.step(batch, out).loss))
        run.step, run.next_batch_index = run.step + 1, run.next_batch_index + 1
        if run.step == 3:
            save_run_checkpoint(run)
    return run


# ------------------------------------------------------------------ noise, width, packing


@pytest.mark.usefixtures("tiny_target")
def test_bad_noise_schedule_is_one_line(tmp_path) -> None:
    cases = (
        ("half", "expected 'all' or 'linear:START:END'"),
        ("linear:0:1", "outside (0, 1]"),
        ("linear:a:1", "numbers"),
    )
    for spec, fragment in cases:
        result = invoke(train_args(tmp_path, noise_schedule=spec))
        assert_one_line_error(result, f"--noise-schedule {spec!r}", fragment)


@pytest.mark.usefixtures("tiny_target")
def test_partial_noise_scores_only_masked_positions_and_anneals(tmp_path) -> None:
    cfg = small_cfg(tmp_path, noise_schedule="linear:0.3:1", steps=10, num_anchors=8)
    run = cpu_run(cfg)
    batch = run.train_data.batch(0)
    early = run.trainer.block_inputs(batch)
    masked = early.block_ids == run.drafter.mask_id
    assert (early.valid <= masked).all()  # a visible token is never a label
    in_row = early.keep[..., None] & (early.anchors[..., None] + torch.arange(4) < 32)
    assert (~masked[..., 1:] & in_row[..., 1:]).any()  # some stay visible at step 0
    run.trainer.step_count = 10  # the schedule's end: everything masked again
    late = run.trainer.block_inputs(batch)
    assert (late.block_ids[..., 1:] == run.drafter.mask_id).all()
    result = invoke(train_args(tmp_path, noise_schedule="linear:0.3:1"))
    assert "noise: masked share 0.3 -> 1 over 2 steps" in result.output


@pytest.mark.usefixtures("tiny_target")
def test_drafter_intermediate_size_defaults_to_the_targets(tmp_path) -> None:
    assert invoke(train_args(tmp_path)).exit_code == 0
    assert saved_drafter(tmp_path)[0]["intermediate_size"] == SMALL_LM.intermediate_size
    result = invoke(train_args(tmp_path, drafter_intermediate_size=40, overwrite=True))
    assert result.exit_code == 0, result.output
    config, meta = saved_drafter(tmp_path)
    assert config["intermediate_size"] == 40
    assert meta["training_config"]["drafter"]["intermediate_size"] == 40
    assert meta["training_config"] == json.loads((tmp_path / "config.json").read_text())
    assert meta["data_fingerprint"] == cpu_run(small_cfg(tmp_path)).train_data.fingerprint()
    result = invoke(train_args(tmp_path, drafter_intermediate_size=0))
    assert_one_line_error(result, "--drafter-intermediate-size")


@pytest.mark.usefixtures("tiny_target")
def test_checkpoint_manifest_covers_the_drafter_directory(tmp_path) -> None:
    run = cpu_run(small_cfg(tmp_path))
    path = save_run_checkpoint(run)
    manifest = json.loads((path / "manifest.json").read_text())["sha256"]
    assert {"drafter/config.json", "drafter/model.safetensors", "drafter/dflash_train.json"} <= set(
        manifest
    )
    (path / "drafter" / "model.safetensors").write_bytes(b"damaged")
    result = invoke(train_args(tmp_path, resume="latest"))
    assert_one_line_error(result, "corrupt", "drafter/model.safetensors")


def _prose_row(first: str, second: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One 32-token row: document 0 (14 tokens) then document 1 (18 tokens)."""
    tokens = list(first.encode())[:14] + list(second.encode())[:18]
    doc_ids = [0] * 14 + [1] * 18
    return torch.tensor([tokens]), torch.tensor([doc_ids])


def _one_step_loss(run, ids, doc_ids) -> torch.Tensor:
    """The loss of a real trainer step (fresh copy of the run's drafter) on one row whose
    loss mask covers document 1 only: every anchor and label lies in it."""
    docs = doc_ids if run.cfg.data.packing == "docs" else None
    positions = None if docs is None else document_positions(docs)
    batch = Batch(0, ids, doc_ids == 1, docs, positions)
    drafter = copy.deepcopy(run.drafter)
    trainer = DrafterTrainer(drafter, run.cfg, "cpu")
    out = capture_fn(run.target, run.layer_ids, False, torch.device("cpu"))(batch)
    return trainer.step(batch, out).loss


@pytest.mark.parametrize("packing", ["docs", "concat"])
@pytest.mark.usefixtures("tiny_target")
def test_another_document_of_the_row_changes_nothing_with_docs_packing(tmp_path, packing):
    run = cpu_run(small_cfg(tmp_path, packing=packing, num_anchors=8))
    mine = "    return sorted(items, key=len)\n"
    ids_a, doc_ids = _prose_row("import os, sys\n", mine)
    ids_b, _ = _prose_row("x = [1, 2, 3]\n\n", mine)
    assert not torch.equal(ids_a, ids_b)
    loss_a, loss_b = (_one_step_loss(run, ids, doc_ids) for ids in (ids_a, ids_b))
    if packing == "docs":
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    else:  # one sequence: the first document is context of the second's blocks
        assert not torch.allclose(loss_a, loss_b, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("tiny_target")
def test_concat_packing_keeps_the_previous_step_loss(tmp_path) -> None:
    """packing=concat: the step is what it was before documents existed (same draws)."""
    run = cpu_run(small_cfg(tmp_path, packing="concat"))
    cfg, bs = run.cfg, run.cfg.drafter.block_size
    for index in range(3):
        batch = run.train_data.batch(index)
        assert batch.doc_ids is None
        out = run.target.capture(batch.input_ids, run.layer_ids, with_logits=False)
        gen = torch.Generator().manual_seed(anchor_seed(cfg.run.seed, batch.batch_id))
        anchors, keep = select_anchors(batch.loss_mask, cfg.loss.num_anchors, gen)
        block_ids = build_blocks(
            batch.input_ids, anchors, bs, run.drafter.mask_id, NoiseSchedule(), index, gen
        )
        labels, valid = block_labels(batch.input_ids, batch.loss_mask, anchors, keep, bs)
        logits = run.drafter(out.hidden, block_ids, anchors, keep)
        expected = dflash_loss(logits.float(), labels, valid, cfg.loss).loss.detach()
        got = run.trainer.step(batch, out).loss
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("tiny_target")
def test_data_report_reaches_the_train_log(tmp_path) -> None:
    lines = [json.dumps({"text": "def f(x):\n    return x + 1\n" * 20})] * 30
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join([*lines[:3], "[1, 2]", *lines[3:]]) + "\n")
    result = invoke(train_args(tmp_path, data=data))
    assert result.exit_code == 0, result.output
    assert "data: skipped 1 unusable JSONL lines (first: " in result.output


@pytest.mark.slow  # builds a small transformers model
def test_without_mask_token_or_spare_row_an_unused_special_token_masks(tmp_path) -> None:
    """As SmolLM2 or Llama-3.x: the tokenizer's length is the vocabulary and it has no
    mask token, but special tokens chat data never contains."""
    from transformers import AutoModelForCausalLM

    from tests.dflash.hf_fixtures import qwen3_config, save_word_tokenizer

    target_dir = tmp_path / "target"
    tok = save_word_tokenizer(target_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<empty_output>", "<reserved_1>"]})
    tok.save_pretrained(target_dir)
    torch.manual_seed(0)
    config = qwen3_config(len(tok), eos_token_id=tok.eos_token_id)  # no spare row
    AutoModelForCausalLM.from_config(config).save_pretrained(target_dir)
    result = invoke(train_args(tmp_path, target=str(target_dir)))
    assert result.exit_code == 0, result.output
    expected = tok.convert_tokens_to_ids("<empty_output>")
    (line,) = [line for line in result.output.splitlines() if line.startswith("mask token")]
    assert line.startswith(f"mask token id {expected} ('<empty_output>': the tokenizer has"), line
    config_saved, meta = saved_drafter(tmp_path)
    assert config_saved["dflash_config"]["mask_token_id"] == expected
    assert meta["mask_token_source"] == "unused-special"


@pytest.mark.usefixtures("tiny_target")
def test_save_dtype_sets_the_final_drafters_precision_and_checkpoints_keep_theirs(tmp_path):
    from safetensors.torch import load_file

    result = invoke(train_args(tmp_path, save_dtype="bfloat16"))
    assert result.exit_code == 0, result.output
    config, _ = saved_drafter(tmp_path)
    assert config["torch_dtype"] == "bfloat16"
    final = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    (checkpoint,) = (tmp_path / "checkpoints").iterdir()
    kept = load_file(str(checkpoint / "drafter" / "model.safetensors"))
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    assert {t.dtype for t in kept.values()} == {torch.float32}  # a resume stays exact
    assert_one_line_error(invoke(train_args(tmp_path, save_dtype="int8")), "--save-dtype", "int8")
