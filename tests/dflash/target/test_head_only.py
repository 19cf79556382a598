"""A target loaded for its embedding, LM head and final norm alone (training from
per-sample hidden-state files): those equal the whole model's, the decoder holds no
weights, and training from the files gives the losses of the whole target."""

import json

import pytest
import torch
from click.testing import CliRunner

from dflash.cli import cli
from dflash.target.load import load_target
from tests.dflash.app_fixtures import record_losses
from tests.dflash.hf_fixtures import WORDS, save_hf_target


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_head_is_the_whole_models_and_the_decoder_holds_nothing(tmp_path, arch):
    directory = save_hf_target(tmp_path / arch, arch)
    whole, head = load_target(str(directory)), load_target(str(directory), head_only=True)
    assert head.head_only and not whole.head_only
    assert torch.equal(head.embed_tokens.weight, whole.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, whole.lm_head.weight)
    assert torch.equal(head.final_norm().weight, whole.final_norm().weight)
    decoder = [p for n, p in head.model.named_parameters() if ".layers." in n]
    assert decoder and all(p.is_meta for p in decoder)
    assert head.tokenizer.vocab == whole.tokenizer.vocab and head.geometry == whole.geometry
    with pytest.raises((NotImplementedError, RuntimeError)):
        head.capture(torch.tensor([[1, 2, 3]]), [0], with_logits=False)


def test_training_from_files_loads_the_whole_target_only_to_evaluate(tmp_path, monkeypatch):
    directory = save_hf_target(tmp_path / "target", "qwen3")
    corpus = tmp_path / "chats.jsonl"
    chats = []
    for i in range(40):
        question, answer = " ".join(WORDS[i % 7 : i % 7 + 5]), " ".join(WORDS[i % 5 : i % 5 + 9])
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append({"messages": messages})
    corpus.write_text("".join(json.dumps(c) + "\n" for c in chats))
    paths = ["--target", str(directory), "--data", str(corpus)]
    opts = [*paths, *"--seq-len 48 --batch-size 2 --drafter-layers 1 --use-soft-labels".split()]
    cache = tmp_path / "cache"
    args = ["cache-hidden", "--format", "speculators", "--output", str(cache), *opts]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output

    def train(out: str, *more: str):
        seen = record_losses(monkeypatch)
        run = ["--steps", "5", "--output-dir", str(tmp_path / out), *more]
        rest = "--log-every 1 --block-size 4".split()
        args = ["train", "--hidden-cache", str(cache), *opts, *run, *rest]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        summary = json.loads((tmp_path / out / "summary.json").read_text())
        return [loss for _, loss in seen], result.output, summary

    # Evaluating in process, a target that fits in half the host's memory loads whole,
    # for the evaluations alone: τ while training and the final one.
    whole_losses, said, summary = train("whole", "--eval-prompts", "2")
    assert "loaded whole for the evaluations alone" in said
    assert summary["tau"] is not None
    # One that does not fit (here: no share of the host's memory may hold it), or a run
    # that does not evaluate, loads the head alone and trains to the same losses.
    from dflash.run import cached_features

    monkeypatch.setattr(cached_features, "HOST_SHARE", 0.0)
    head_losses, said, summary = train("head", "--eval-prompts", "2")
    assert "only its embedding, LM head and final norm are loaded" in said
    assert summary["tau"] is None and "without its decoder" in summary["eval_skipped"]
    quiet_losses, said, _ = train("quiet", "--eval-prompts", "0")
    assert "only its embedding" in said
    assert head_losses == whole_losses == quiet_losses and len(head_losses) == 5
