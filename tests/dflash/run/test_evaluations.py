"""τ while training (--eval-every, --keep-best): the steps asked, the final evaluation
on the last step's line, the budget of the default, the best drafter kept."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dflash.config.schema import ConfigError
from dflash.config.settings import RunConfig
from dflash.drafter.io import load_drafter
from dflash.eval.evaluate import evaluate_tau
from dflash.run import pipelined
from dflash.run.checkpoint import load_checkpoint, resolve_checkpoint
from dflash.run.evaluations import BUDGET_SHARE, Best, TrainingEvals, trainable_weights
from dflash.run.finish import keep_best
from dflash.run.reference import train_reference
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    cpu_run,
    small_cfg,
    tiny_target,
)

EVAL = {"eval_prompts": 2, "eval_new_tokens": 8, "eval_prompt_tokens": 8}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(loop: str, cfg) -> dict:
    if loop == "reference":
        return train_reference(cfg, log=lambda _: None)
    return pipelined.run_pipeline(cfg, log=lambda _: None)


@pytest.mark.usefixtures("tiny_target")
@pytest.mark.parametrize("loop", ["reference", "pipeline"])
def test_eval_every_lands_on_the_steps_asked_and_the_last_is_the_final(tmp_path, loop) -> None:
    cfg = small_cfg(tmp_path, steps=6, eval_every=2, log_every=5, **EVAL)
    summary = _train(loop, cfg)
    lines = _metrics(tmp_path)
    evaluated = [line["step"] for line in lines if "eval_tau" in line]
    assert evaluated == [2, 4, 6]  # 2 and 4 while training (logged for it), 6 the final
    last = lines[-1]
    assert last["step"] == 6 and last["eval_tau"] == summary["tau"]
    assert last["eval_tau_pooled"] == summary["tau_pooled"]
    assert last["eval_acceptance_per_position"] == summary["acceptance_per_position"]
    assert "eval_s" not in last  # measured once, by the final evaluation
    during = summary["evaluations_while_training"]
    assert during["evaluations"] == 2 and during["seconds"] > 0
    assert [point["step"] for point in during["curve"]] == [2, 4, 6]
    for line in lines:
        assert 1.0 <= line.get("eval_tau", 1.0) <= cfg.drafter.block_size
        assert line["tau_chain"] >= 1.0  # the per-block chain, logged on every line


@pytest.mark.usefixtures("tiny_target")
def test_keep_best_saves_the_drafter_of_the_best_evaluation(tmp_path) -> None:
    cfg = small_cfg(tmp_path, steps=12, eval_every=4, keep_best=True, **EVAL)
    run = cpu_run(cfg)  # the target and prompts the evaluations used
    summary = train_reference(cfg, log=lambda _: None)
    during = summary["evaluations_while_training"]
    taus = {point["step"]: point["tau"] for point in during["curve"]}
    best_step = max(taus, key=lambda step: (taus[step], -step))  # the first of the best
    assert during["best_step"] == best_step == summary["drafter_step"]
    drafter, _ = load_drafter(tmp_path / "drafter", run.target)
    again = evaluate_tau(run.target, drafter, run.evals.prompts, cfg.run.eval_new_tokens)
    assert float(again.tau) == pytest.approx(taus[best_step], abs=1e-9)
    final = load_checkpoint(resolve_checkpoint("latest", tmp_path))
    assert final.step == 12
    saved = trainable_weights(drafter)
    same = all(torch.equal(saved[name], final.weights[name]) for name in saved)
    assert same == (best_step == 12)  # the last weights stay in the final checkpoint


@pytest.mark.usefixtures("tiny_target")
def test_keep_best_writes_the_kept_weights_and_leaves_the_drafter_as_it_was(tmp_path) -> None:
    cfg = small_cfg(tmp_path, steps=12, eval_every=4, keep_best=True, **EVAL)
    run = cpu_run(cfg)
    last = trainable_weights(run.drafter)
    best = {name: torch.full_like(w, 0.25) for name, w in last.items()}
    assert run.evals is not None
    run.evals.best = Best(step=4, tau=7.0, weights=best)
    keep_best(run, lambda _: None)
    saved, _ = load_drafter(tmp_path / "drafter", run.target)
    for name, weight in trainable_weights(saved).items():
        assert torch.equal(weight, best[name]), name
    for name, weight in trainable_weights(run.drafter).items():
        assert torch.equal(weight, last[name]), name


def _evals(**run: object) -> TrainingEvals:
    cfg = RunConfig(**{"steps": 100, **run})  # type: ignore[arg-type]
    return TrainingEvals(cfg, target=None, drafter=None, prompts=[])  # type: ignore[arg-type]


def test_the_default_evaluates_within_its_budget() -> None:
    evals = _evals()
    evals._last_cost_s = 1.0  # the first one's estimate
    # The first evaluation waits until its estimated cost fits the budget: a run whose
    # first logged step comes early does not spend its share on the untrained drafter.
    assert not evals.due(1, train_s=1 / BUDGET_SHARE - 0.1)
    assert evals.due(2, train_s=1 / BUDGET_SHARE + 0.1)
    evals.history.append({"step": 2})
    evals.spent_s = 1.0
    # Two evaluations of 1 s fit once the training proper (evaluations not counted) is
    # 2 / BUDGET_SHARE s long.
    assert not evals.due(10, train_s=1.0 + 2 / BUDGET_SHARE - 0.1)
    assert evals.due(11, train_s=1.0 + 2 / BUDGET_SHARE + 0.1)
    assert not evals.due(100, train_s=10_000.0)  # the last step's is the final one


def test_walks_leave_half_the_budget_to_decoding() -> None:
    """Serving walks are cheap and run at every logged step they fit; were they free to
    take the whole budget, the default would never decode (the default run did not,
    once the first evaluation waited for its cost)."""
    evals = _evals()
    evals._last_cost_s, evals._last_walk_s = 1e9, 1.0  # decoding never fits here
    # 1,000 s of training with 40 s of walks in it: the budget is 10 % of the 960 s of
    # training proper, half of it (48 s) for walks.
    evals.walk_spent_s = evals.spent_s = 40.0
    assert evals._walk_fits(1000.0)
    evals.walk_spent_s = evals.spent_s = 47.0  # 48 s with the next walk: over 47.65
    assert not evals._walk_fits(1000.0)


@pytest.mark.usefixtures("tiny_target")
def test_the_first_evaluations_estimate_does_not_undershoot(tmp_path) -> None:
    """The estimate (one prompt's prefill and two cycles, scaled as if nothing were
    accepted) is at least what the untrained drafter's evaluation then costs, give or
    take the timer's noise: the budget is a bound, not a hope."""
    run = cpu_run(small_cfg(tmp_path, steps=10, **EVAL))
    evals = run.evals
    assert evals is not None
    estimate_s = evals._next_cost_s()
    assert evals.spent_s > 0  # measuring it counts
    start = evals.spent_s
    evals.evaluate(1)
    assert estimate_s >= 0.5 * (evals.spent_s - start)


def test_eval_every_asks_for_exact_steps() -> None:
    evals = _evals(eval_every=25)
    assert [s for s in range(1, 101) if evals.due(s, train_s=0.0)] == [25, 50, 75]


@pytest.mark.parametrize(
    ("run", "line"),
    [
        ({"eval_every": 5, "eval_prompts": 0}, "--eval-every 5 needs held-out prompts"),
        ({"eval_every": 200}, "--eval-every 200 is invalid: larger than --steps 100"),
        ({"keep_best": True, "eval_every": 0}, "--keep-best needs evaluations while training"),
        ({"keep_best": True, "eval_prompts": 0}, "--keep-best needs evaluations while training"),
    ],
)
def test_bad_evaluation_settings_are_one_line(run: dict, line: str) -> None:
    with pytest.raises(ConfigError, match=line):
        RunConfig(**{"steps": 100, **run})


@pytest.mark.usefixtures("tiny_target")
def test_eval_dtype_decodes_a_copy_of_the_target_in_that_dtype(tmp_path, monkeypatch) -> None:
    """--eval-dtype bfloat16 on a run that trains in fp32: every evaluation (while
    training and the final one) decodes with a bf16 copy; the run keeps its prompts."""
    from dflash.eval import evaluate as evaluate_mod
    from dflash.run import evaluations

    seen: list[torch.dtype] = []
    real = evaluate_mod.evaluate_tau

    def spy(target, *args, **kwargs):
        seen.append(target.embed_tokens.weight.dtype)
        return real(target, *args, **kwargs)

    monkeypatch.setattr(evaluate_mod, "evaluate_tau", spy)
    monkeypatch.setattr(evaluations, "evaluate_tau", spy)
    lines: list[str] = []
    cfg = small_cfg(tmp_path, steps=4, eval_every=2, eval_dtype="bfloat16", **EVAL)
    summary = pipelined.run_pipeline(cfg, log=lines.append)
    assert any("the target decodes in bfloat16" in line for line in lines), lines
    assert seen and set(seen) == {torch.bfloat16}  # the estimate, step 2, the final one
    assert summary["tau"] is not None
    record = json.loads((tmp_path / "eval_prompts.json").read_text())
    assert len(record["prompts"]) == EVAL["eval_prompts"]
    assert record["max_new_tokens"] == EVAL["eval_new_tokens"]


@pytest.mark.usefixtures("tiny_target")
def test_eval_on_the_runs_own_prompts_measures_the_summarys_tau(tmp_path) -> None:
    """`eval --eval-data OUTPUT_DIR/eval_prompts.json` decodes the token ids the run
    measured its τ on: the saved drafter's τ is summary.json's, figure for figure, and
    the eval JSON reads back typed."""
    from dflash.eval.config import EvalConfig
    from dflash.eval.evaluate import evaluate_drafter_dir
    from dflash.summary import EvalRecord

    (tmp_path / "run").mkdir()
    cfg = small_cfg(tmp_path / "run", steps=4, **EVAL)
    summary = pipelined.run_pipeline(cfg, log=lambda _: None)
    lines: list[str] = []
    settings = EvalConfig(
        eval_data=str(tmp_path / "run" / "eval_prompts.json"),
        max_new_tokens=EVAL["eval_new_tokens"] + 1,  # not the run's: said in one line
        num_prompts=None,
    )
    record = evaluate_drafter_dir(tmp_path / "run" / "drafter", None, settings, "cpu", lines.append)
    assert any("--max-new-tokens 8; this evaluation uses 9" in line for line in lines), lines
    assert record.prompts == EVAL["eval_prompts"]
    exact = dataclasses.replace(settings, max_new_tokens=EVAL["eval_new_tokens"])
    record = evaluate_drafter_dir(tmp_path / "run" / "drafter", None, exact, "cpu", lines.append)
    assert record.held_out is not None
    assert (record.held_out.tau, record.tau_pooled) == (summary["tau"], summary["tau_pooled"])
    assert record.held_out.acceptance_per_position == summary["acceptance_per_position"]
    assert EvalRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
