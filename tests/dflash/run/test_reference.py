import json
import math

import pytest
import torch

from dflash.config.devices import decide_placement
from dflash.files import sha256_file
from dflash.nn.schedule import warmup_cosine
from dflash.run.build import build_run
from dflash.run.checkpoint import CheckpointError
from dflash.run.finish import RunStats, save_run_checkpoint
from dflash.run.reference import train_reference
from dflash.train.step import DrafterTrainer, anchor_seed
from tests.dflash.app_fixtures import cpu_run, small_cfg, tiny_target  # noqa: F401 - fixture
from tests.dflash.hf_fixtures import save_tiny_hf_model


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    factors = [warmup_cosine(s, 4, 20, 0.1) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert factors[20] == pytest.approx(0.1)


def test_anchor_seed_depends_only_on_seed_and_batch() -> None:
    assert anchor_seed(0, 5) == anchor_seed(0, 5)
    assert len({anchor_seed(0, 5), anchor_seed(0, 6), anchor_seed(1, 5)}) == 3


@pytest.mark.usefixtures("tiny_target")
def test_step_runs_its_phases_and_trains_only_the_drafter(tmp_path) -> None:
    run = cpu_run(small_cfg(tmp_path))
    seen = []

    def phase(name):
        seen.append(name)
        return torch.autograd.profiler.record_function(name)

    synced = []

    def grad_sync(weighted: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        synced.append(seen[-1])
        return weighted / denominator

    run.trainer.grad_sync = grad_sync
    frozen = run.target.embed_tokens.weight.detach().clone()
    before = {n: p.detach().clone() for n, p in run.drafter.named_parameters()}
    batch = run.train_data.batch(0)
    out = run.target.capture(batch.input_ids, run.layer_ids, with_logits=False)
    result = run.trainer.step(batch, out, phase=phase)
    # With replicas, the gradients are combined in a phase of its own after backward.
    phases = ("anchor_selection", "block_prediction", "loss", "backward", "grad_sync", "optimizer")
    assert seen == [f"drafter.{p}" for p in phases]
    assert synced == ["drafter.grad_sync"]
    assert math.isfinite(float(result.loss)) and result.num_tokens == 2 * 32
    assert result.loss.device == run.drafter_device and result.figures is None
    assert torch.equal(run.target.embed_tokens.weight, frozen)
    assert any(not torch.equal(before[n], p) for n, p in run.drafter.named_parameters())


@pytest.mark.usefixtures("tiny_target")
def test_same_batch_gives_the_same_loss_regardless_of_order(tmp_path) -> None:
    """Anchors come from (seed, batch id), not from a shared RNG's history."""
    losses = []
    for order in ([3, 5], [5, 3]):
        run = cpu_run(small_cfg(tmp_path))
        trainer = DrafterTrainer(run.drafter, run.cfg, "cpu")
        trainer.optimizer.param_groups[0]["lr"] = 0.0  # keep weights fixed
        trainer.scheduler.base_lrs = [0.0]
        per_batch = {}
        for index in order:
            batch = run.train_data.batch(index)
            out = run.target.capture(batch.input_ids, run.layer_ids, with_logits=False)
            torch.manual_seed(index * 7 + len(per_batch))  # disturb the global RNG
            per_batch[index] = float(trainer.step(batch, out).loss)
        losses.append(per_batch)
    assert losses[0] == losses[1]


@pytest.mark.usefixtures("tiny_target")
def test_soft_labels_and_streak_weights_train(tmp_path) -> None:
    cfg = small_cfg(tmp_path, steps=2, use_soft_labels=True, kl_weight=0.7, streak_alpha=0.5)
    summary = train_reference(cfg, log=lambda s: None)
    assert math.isfinite(summary["final_loss"]) and summary["steps"] == 2


@pytest.mark.usefixtures("tiny_target")
def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path) -> None:
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full_log, part_log = [], []

    def losses(cfg, sink, stop_at=None):
        run = cpu_run(cfg)
        while run.step < (stop_at or cfg.run.steps):
            batch = run.train_data.batch(run.next_batch_index)
            out = run.target.capture(batch.input_ids, run.layer_ids, with_logits=False)
            sink.append(float(run.trainer.step(batch, out).loss))
            run.step, run.next_batch_index = run.step + 1, run.next_batch_index + 1
            if run.step == 3:
                save_run_checkpoint(run)
        return run

    losses(small_cfg(tmp_path, full_dir), full_log)
    losses(small_cfg(tmp_path, part_dir), part_log, stop_at=3)  # "crash" after step 3
    resumed = small_cfg(tmp_path, part_dir, resume="latest")
    losses(resumed, part_log)
    assert len(full_log) == 6 and part_log == full_log


@pytest.mark.usefixtures("tiny_target")
def test_train_reference_writes_summary_drafter_and_checkpoints(tmp_path) -> None:
    lines = []
    cfg = small_cfg(tmp_path, save_every=2)
    summary = train_reference(cfg, log=lines.append)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["steps"] == 6 and on_disk["tokens_per_s"] > 0
    assert set(on_disk) >= {"steps", "tokens_per_s", "final_loss", "tau", "wall_s"}
    assert on_disk["final_loss"] == pytest.approx(summary["final_loss"])
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step-00000002", "step-00000004", "step-00000006"]
    assert any(line.startswith("loss: block size 4") for line in lines)


@pytest.mark.usefixtures("tiny_target")
def test_a_run_reading_the_targets_last_layer_warns_once_naming_the_engines(tmp_path) -> None:
    lines: list[str] = []
    train_reference(small_cfg(tmp_path, target_layers=(1, 3), steps=1), log=lines.append)
    (warning,) = [line for line in lines if "last decoder layer" in line]  # 4-layer target
    assert warning.startswith("warning: target layer 3") and "\n" not in warning
    assert "SGLang cannot capture it" in warning and "speculators" in warning
    cfg = small_cfg(tmp_path, tmp_path / "b", target_layers=(1, 2))
    quiet: list[str] = []
    build_run(cfg, decide_placement(cfg.pipeline), log=quiet.append)
    assert quiet and not [line for line in quiet if "last decoder layer" in line]


def test_unused_stats_type_is_constructible() -> None:
    assert RunStats([1.0], 10, 0.5).num_tokens == 10


@pytest.mark.usefixtures("tiny_target")
def test_resume_refuses_another_drafter_shape(tmp_path) -> None:
    train_reference(small_cfg(tmp_path, steps=1), log=lambda s: None)
    with pytest.raises(CheckpointError, match="block_size"):
        cpu_run(small_cfg(tmp_path, resume="latest", block_size=6))


@pytest.mark.slow
def test_tiny_hugging_face_target_on_chat_data_end_to_end(tmp_path) -> None:
    model_dir = tmp_path / "hf"
    save_tiny_hf_model(model_dir)
    chats = tmp_path / "chats.jsonl"
    turn = [{"role": "user", "content": "add one"}, {"role": "assistant", "content": "x + 1"}]
    chats.write_text("\n".join(json.dumps({"messages": turn}) for _ in range(60)) + "\n")
    options = dict(target=str(model_dir), data=str(chats), steps=3, use_soft_labels=True)
    evaluation = dict(eval_prompts=1, eval_new_tokens=6, eval_prompt_tokens=6)
    cfg = small_cfg(tmp_path, tmp_path / "out", **options, **evaluation)
    summary = train_reference(cfg, log=lambda s: None)
    assert summary["steps"] == 3 and math.isfinite(summary["final_loss"])
    assert 1.0 <= summary["tau"] <= cfg.drafter.block_size
    saved = json.loads((tmp_path / "out" / "drafter" / "config.json").read_text())
    meta = json.loads((tmp_path / "out" / "drafter" / "dflash_train.json").read_text())
    assert meta["target"] == str(model_dir) and meta["mask_token_source"] == "spare-row"
    # The first spare embedding row past the tokenizer's vocabulary (8 spare rows).
    assert saved["dflash_config"]["mask_token_id"] == saved["vocab_size"] - 8


@pytest.mark.usefixtures("tiny_target")
def test_a_summary_before_any_finished_step_holds_null_not_nan(tmp_path) -> None:
    """Interrupted at step 0 (or diverged), summary.json must stay JSON."""
    from dflash.run.finish import RunStats, build_summary
    from dflash.run.progress import format_summary

    run = cpu_run(small_cfg(tmp_path))
    summary = build_summary(run, RunStats([], 0, 0.0), 0.0, interrupted="SIGINT")
    assert summary["final_loss"] is None
    json.dumps(summary, allow_nan=False)  # raises on NaN or inf
    nan_run = build_summary(run, RunStats([float("nan")], 1, 1.0), 0.0)
    assert nan_run["final_loss"] is None
    assert "final loss n/a" in format_summary(summary)


@pytest.mark.usefixtures("tiny_target")
def test_a_resume_continues_metrics_jsonl_without_glued_or_repeated_lines(tmp_path) -> None:
    out = tmp_path / "out"
    opts = {"log_every": 1, "save_every": 2, "keep_checkpoints": 5}
    train_reference(small_cfg(tmp_path, out, **opts), log=lambda _: None)
    path = out / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 7, "lo')  # a crash mid-line
    earlier = sorted((out / "checkpoints").iterdir())[0]  # step 2
    train_reference(small_cfg(tmp_path, out, resume=str(earlier), **opts), log=lambda _: None)
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.usefixtures("tiny_target")
def test_resume_refuses_other_data(tmp_path) -> None:
    train_reference(small_cfg(tmp_path, steps=2), log=lambda s: None)
    other = tmp_path / "other.txt"
    other.write_text("x = [i * i for i in range(10)]\n" * 300)
    with pytest.raises(CheckpointError, match="checkpoint has data.source="):
        cpu_run(small_cfg(tmp_path, resume="latest", data=str(other)))
    with pytest.raises(CheckpointError, match="checkpoint has data.seq_len=32, this run 48"):
        cpu_run(small_cfg(tmp_path, resume="latest", seq_len=48))
    with pytest.raises(CheckpointError, match="data.chat_rendering='whole', this run 'per-turn'"):
        cpu_run(small_cfg(tmp_path, resume="latest", chat_rendering="per-turn"))


@pytest.mark.usefixtures("tiny_target")
def test_a_checkpoint_from_before_chat_rendering_resumes_as_whole(tmp_path) -> None:
    train_reference(small_cfg(tmp_path, steps=1), log=lambda s: None)
    (checkpoint,) = (tmp_path / "checkpoints").iterdir()
    config = json.loads((checkpoint / "config.json").read_text())
    del config["data"]["chat_rendering"]  # as an older version wrote it
    (checkpoint / "config.json").write_text(json.dumps(config))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["sha256"]["config.json"] = sha256_file(checkpoint / "config.json")
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    assert cpu_run(small_cfg(tmp_path, resume="latest", steps=2)).step == 1
    with pytest.raises(CheckpointError, match="data.chat_rendering='whole'"):
        cpu_run(small_cfg(tmp_path, resume="latest", steps=2, chat_rendering="per-turn"))


@pytest.mark.usefixtures("tiny_target")
def test_resume_refuses_edited_data_unless_allowed(tmp_path) -> None:
    train_reference(small_cfg(tmp_path, steps=2, save_every=1), log=lambda s: None)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("y = {k: k + 1 for k in range(9)}\n" * 300)  # same path, other rows
    with pytest.raises(CheckpointError, match="training rows changed.*--allow-data-change"):
        cpu_run(small_cfg(tmp_path, resume="latest", steps=4))
    with pytest.raises(CheckpointError, match="--allow-data-change continues"):
        cpu_run(small_cfg(tmp_path, resume="latest", seq_len=48))
    run = cpu_run(small_cfg(tmp_path, resume="latest", steps=4, allow_data_change=True))
    assert run.step == 2  # continues from its checkpoint, on the new rows


@pytest.mark.usefixtures("tiny_target")
def test_the_summary_sets_the_training_tau_estimate_beside_the_evaluation_tau(tmp_path) -> None:
    lines: list[str] = []
    cfg = small_cfg(tmp_path, eval_prompts=2, eval_new_tokens=8, eval_prompt_tokens=8, log_every=2)
    summary = train_reference(cfg, log=lines.append)
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["tau_estimate"] == pytest.approx(last["tau_estimate"])
    assert 0.0 <= summary["repeated_share"] <= 1.0
    assert any("training's τ estimate" in line for line in lines)
