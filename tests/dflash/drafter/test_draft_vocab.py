"""--draft-vocab-size: the chosen tokens, the pruned head's loss, the saved mappings in
the form vLLM reads them, evaluation in target ids, and the bad values."""

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash import cli as cli_mod
from dflash.config.settings import LossConfig
from dflash.drafter.io import load_drafter, pruned_head_note, save_drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.drafter.vocab import DraftVocabError, check_draft_vocab_size, select_draft_vocab
from dflash.objective.loss import chunked_dflash_loss
from dflash.target.load import wrap_tiny
from dflash.target.tiny import TinyLM
from tests.dflash.app_fixtures import SMALL_LM, small_options, tiny_target  # noqa: F401


def test_the_most_frequent_label_tokens_are_kept_with_the_required_ones():
    ids = torch.tensor([[5, 5, 5, 9, 9, 2, 7, 7, 7, 7]])
    learnable = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    vocab = select_draft_vocab(ids, learnable, 3, 12, required=(11,))
    # 5 (3 labels) and 9 (2) beat 7, which is frequent only outside the loss mask.
    assert vocab.target_ids.tolist() == [5, 9, 11]
    assert vocab.coverage == pytest.approx(5 / 6)
    assert vocab.d2t().tolist() == [5, 8, 9]  # target id = draft id + d2t[draft id]
    assert vocab.t2d().nonzero().flatten().tolist() == [5, 9, 11]
    # Places left once every label token is in: the most frequent anywhere, then low ids.
    wide = select_draft_vocab(ids, learnable, 6, 12, required=(11,))
    assert wide.target_ids.tolist() == [0, 2, 5, 7, 9, 11]
    assert wide.coverage == 1.0


def test_sizes_that_cannot_hold_a_vocabulary_are_named():
    with pytest.raises(DraftVocabError, match="--draft-vocab-size 300 is larger than .* 260"):
        check_draft_vocab_size(300, 260)
    with pytest.raises(DraftVocabError, match=r"--draft-vocab-size 2 cannot hold the 3 .*\[1, 4\]"):
        check_draft_vocab_size(2, 260, stop_ids=(1, 4))
    check_draft_vocab_size(3, 260, stop_ids=(1, 4))


@pytest.fixture
def target():
    torch.manual_seed(0)
    return wrap_tiny(TinyLM(SMALL_LM), spec="builtin:tiny")


def pruned(target, kept: list[int], seed: int = 3) -> DFlashDrafter:
    vocab_size = target.embed_tokens.num_embeddings
    ids = torch.tensor([kept])
    learnable = torch.ones_like(ids, dtype=torch.bool)
    vocab = select_draft_vocab(ids, learnable, len(kept), vocab_size, required=())
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=4, draft_vocab_size=vocab.size)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head, vocab)


def test_the_pruned_head_is_the_targets_rows_and_its_loss_the_softmax_over_them(target):
    kept = [3, 10, 40, 41, 100, 257]
    drafter = pruned(target, kept)
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight[kept])
    assert not drafter.lm_head.weight.requires_grad
    assert "lm_head.weight" not in {n for n, p in drafter.named_parameters() if p.requires_grad}
    hidden = torch.randn(2, 3, 4, 32)
    labels = torch.tensor(kept * 4)[:24].view(2, 3, 4)
    labels[0, 0, 2] = 7  # not in the draft vocabulary
    valid = torch.ones(2, 3, 4, dtype=torch.bool)
    valid[..., 0] = False
    draft, inside = drafter.draft_labels(labels)
    assert inside is not None and not inside[0, 0, 2] and int(inside[valid].sum()) == 17
    cfg = LossConfig(loss_chunk_size=2)
    out = chunked_dflash_loss(hidden, drafter.lm_head, draft, valid, cfg, in_vocab=inside)
    # The oracle: full target logits restricted to the kept columns, labels as positions.
    logits = target.lm_head(hidden)[..., kept]
    ce = F.cross_entropy(logits.reshape(-1, 6), draft.reshape(-1), reduction="none").view(2, 3, 4)
    k = torch.arange(4, dtype=torch.float32)
    w = torch.exp(-(k - 1) / cfg.decay_gamma(4)) * (valid & inside)
    torch.testing.assert_close(out.loss, (w * ce).sum() / w.sum())
    # The left-out label still counts, as a miss, in the accuracy.
    correct = (logits.argmax(-1) == draft) & valid & inside
    torch.testing.assert_close(out.metrics["accuracy"], correct.sum() / valid.sum())


def test_saved_mappings_are_what_vllm_reads_and_drafts_come_back_in_target_ids(target, tmp_path):
    kept = [3, 10, 40, 41, 100, 257]
    drafter = pruned(target, kept)
    save_drafter(drafter, tmp_path, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == 6 and config["vocab_size"] == 260
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert state["lm_head.weight"].shape == (6, 32)
    assert state["lm_head.weight"].dtype == torch.bfloat16
    # vLLM's compute_logits: the draft logit i goes to target id i + d2t[i].
    assert (torch.arange(6) + state["d2t"]).tolist() == kept
    assert state["t2d"].nonzero().flatten().tolist() == kept
    loaded, _ = load_drafter(tmp_path, target=target)
    assert loaded.config.draft_vocab_size == 6
    hidden = torch.randn(1, 9, 32)
    logits = loaded.draft_logits(hidden, anchor_token=5, anchor_pos=9)
    assert logits.shape == (3, 260)
    assert torch.isinf(logits[:, [0, 1, 2, 4, 259]]).all()
    assert set(loaded.draft(hidden, 5, 9)) <= set(kept)
    rounded = drafter.to(torch.bfloat16).to(torch.float32)  # as saved, loaded in fp32
    expected = rounded.draft_logits(hidden, anchor_token=5, anchor_pos=9)
    torch.testing.assert_close(logits, expected)


def test_only_a_pruned_head_is_noted_with_what_each_engine_serves(target):
    whole = DrafterConfig.for_target(target, num_layers=1, block_size=4)
    assert pruned_head_note(whole) is None
    note = pruned_head_note(pruned(target, [3, 10, 40]).config)
    assert note is not None and "3 of the 260 tokens" in note and "\n" not in note
    assert "vLLM serves it as saved" in note and "SGLang" in note


def invoke(tmp_path, output_dir=None, **extra):
    args = ["train"]
    for key, value in {**small_options(tmp_path, output_dir), "steps": 3, **extra}.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return CliRunner().invoke(cli_mod.cli, args, catch_exceptions=False)


@pytest.mark.usefixtures("tiny_target")
def test_training_with_a_draft_vocabulary_saves_and_says_it(tmp_path):
    result = invoke(tmp_path, draft_vocab_size=64, eval_prompts=2, eval_new_tokens=8)
    assert result.exit_code == 0, result.output
    (line,) = [s for s in result.output.splitlines() if s.startswith("draft vocabulary:")]
    assert "the 64 most frequent of the target's 260 tokens" in line, line
    # Said once, at the final save (not at each checkpoint), naming what each engine does.
    (note,) = [s for s in result.output.splitlines() if s.startswith("drafter: its head")]
    assert "64 of the 260 tokens" in note and "vLLM serves it as saved" in note, note
    assert "SGLang would ignore the pruned head" in note, note
    state = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert state["t2d"].sum() == 64
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tau"] is not None and summary["tau"] >= 1.0


@pytest.mark.usefixtures("tiny_target")
@pytest.mark.parametrize(
    ("size", "fragment"),
    [
        ("261", "larger than the target's vocabulary of 260"),
        ("1", "cannot hold the 2 tokens"),
        ("0", "--draft-vocab-size"),
    ],
)
def test_bad_sizes_are_one_line_before_any_work(tmp_path, size, fragment):
    result = invoke(tmp_path, tmp_path / "run", draft_vocab_size=size)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run" / "config.json").exists()
