"""summary.json as a typed record: today's keys written back exactly, old files read."""

from __future__ import annotations

import json

import pytest

from dflash.summary import (
    SCHEMA_VERSION,
    EvalRecord,
    Evaluation,
    HeldOutFigures,
    ServedFigures,
    Summary,
)

# A summary.json as the pipeline wrote it before it was typed (no schema_version).
OLD = {
    "steps": 2900,
    "steps_this_run": 2900,
    "tokens_per_s": 2547.78,
    "final_loss": 10.43,
    "tau": 1.53,
    "tau_pooled": 1.43,
    "acceptance_per_position": [0.28, 0.08, 0.04],
    "tokens_per_target_forward": 1.4,
    "speedup": 0.676,
    "speculative_s": 20.2,
    "greedy_s": 13.6,
    "repeated_share": 0.3865,
    "tau_without_repeats": 1.39,
    "evaluations_while_training": {"evaluations": 2, "curve": [{"step": 20, "tau": 1.48}]},
    "drafter_step": 20,
    "wall_s": 1204.5,
    "train_s": 1165.6,
    "setup_s": 3.7,
    "eval_s": 33.8,
    "bad_steps": 0,
    "block_size": 4,
    "target": "builtin:tiny",
    "target_layer_ids": [1, 7],
    "mask_token_id": 3,
    "mask_token_source": "unused-special",
    "packing": "docs",
    "initialized_from": None,
    "drafter_dir": "/run/drafter",
    "tau_estimate": 1.686,
    "hidden_cache_skipped": {"missing": 0, "unreadable": 1},
    "pipeline": {"world_size": 1, "train_cpu_s": 1071.4},
    "verdict": None,
    "telemetry": {"spans_exported": 0, "files": {"timeline": "/run/timeline.json"}},
}


def test_an_old_summary_reads_by_attribute_and_writes_back_key_for_key() -> None:
    summary = Summary.from_dict(json.loads(json.dumps(OLD)))
    assert summary.schema_version == 0  # written before the schema had a version
    assert (summary.tau, summary.tau_pooled, summary.speedup) == (1.53, 1.43, 0.676)
    assert summary.evaluation.held_out is not None
    assert summary.evaluation.repeated_share == 0.3865
    assert summary.timeline_file == "/run/timeline.json"
    written = summary.to_dict()
    assert written.pop("schema_version") == 0
    assert list(written.items()) == list(OLD.items())  # same keys, values and order


def test_a_new_summary_carries_its_version_and_round_trips() -> None:
    summary = Summary(steps=3, final_loss=None, evaluation=Evaluation(skipped="no decoder"))
    written = summary.to_dict()
    assert written["schema_version"] == SCHEMA_VERSION
    assert (written["tau"], written["eval_skipped"]) == (None, "no decoder")
    assert "verdict" not in written and "telemetry" not in written  # the reference loop's
    assert Summary.from_dict(json.loads(json.dumps(written))) == summary


SERVED = ServedFigures(
    tau=2.5,
    tau_pooled=2.4,
    acceptance_per_position=[0.7, 0.5],
    num_drafts=10,
    num_draft_tokens=20,
    num_accepted_tokens=14,
    num_speculative_tokens=2,
    new_tokens=40,
    requests=4,
    other_traffic=None,
    eval_s=1.5,
    server="vllm",
    vllm_command="vllm",
)


def test_a_served_evaluation_writes_the_engine_block_and_no_speedup() -> None:
    served = SERVED
    written = Summary(evaluation=Evaluation(served=served)).to_dict()
    assert written["speedup"] is None and written["tau_pooled"] == 2.4
    assert written["served"]["vllm_command"] == "vllm" and "server_model" not in written["served"]
    again = Summary.from_dict(written)
    assert again.evaluation.served == served and again.tau == 2.5


def test_unknown_keys_are_kept_and_a_non_object_is_refused() -> None:
    summary = Summary.from_dict({"steps": 1, "tau": None, "a_future_block": {"x": 1}})
    assert summary.to_dict()["a_future_block"] == {"x": 1}
    held = HeldOutFigures.from_dict({"tau": 2.0})
    assert held.tau_pooled == 2.0 and held.repeated_share is None
    with pytest.raises(TypeError, match="holds list"):
        Summary.from_dict([1, 2])  # type: ignore[arg-type]  # a file of another shape


# An eval JSON of `eval --drafter D --server URL` as it was written before it was typed.
OLD_EVAL = {
    **{key: OLD[key] for key in HeldOutFigures.__dataclass_fields__},
    "prompts": 2,
    "turns": 3,
    "new_tokens": 24,
    "max_new_tokens": 12,
    "temperature": 0.0,
    "draft_sampling": "greedy",
    "block_size": 3,
    "target": "builtin:tiny",
    "dtype": "float32",
    "eval_s": 4.5,
    "served": SERVED.to_dict(),
}


def test_an_old_eval_json_reads_typed_and_writes_back_key_for_key() -> None:
    record = EvalRecord.from_dict(json.loads(json.dumps(OLD_EVAL)))
    assert record.schema_version == 0 and record.turns == 3
    assert record.held_out is not None and record.held_out.speculative_s == 20.2
    assert record.served == SERVED and record.tau_pooled == 1.43  # in process first
    written = record.to_dict()
    assert written.pop("schema_version") == 0
    assert list(written.items()) == list(OLD_EVAL.items())


def test_a_server_only_eval_json_has_the_engines_figures_on_top() -> None:
    written = EvalRecord(served=SERVED).to_dict()
    assert written["schema_version"] == SCHEMA_VERSION
    assert written["tau_pooled"] == 2.4 and written["served"]["tau_pooled"] == 2.4
    again = EvalRecord.from_dict(json.loads(json.dumps(written)))
    assert again.held_out is None and again.served == SERVED and again.tau_pooled == 2.4
    with pytest.raises(TypeError, match="holds list"):
        EvalRecord.from_dict([1])  # type: ignore[arg-type]  # a file of another shape
