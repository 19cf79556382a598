"""Step metrics without host syncs: counted per step, in the pipeline and the reference."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

import dflash
from dflash.run import pipelined as pipeline
from dflash.run.reference import train_reference
from dflash.train.step import DrafterTrainer
from dflash.train.step_metrics import tau_estimate
from tests.dflash.app_fixtures import small_cfg, tiny_target  # noqa: F401 - fixture

DFLASH_DIR = str(Path(dflash.__file__).parent)
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")


def count_host_syncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """Events in call order: ("step", n) when step n (1-based) starts, ("sync", where)
    for every tensor-to-host read made by dflash code (not by torch's own Python)."""
    events: list[tuple[str, object]] = []
    lock = threading.Lock()
    for name in SYNCS:
        real = getattr(torch.Tensor, name)

        def patched(self, *args, _real=real, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(DFLASH_DIR):
                with lock:
                    events.append(("sync", f"{_name} in {caller}"))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, patched)
    real_step = DrafterTrainer.step

    def step(self, *args, **kwargs):
        with lock:
            events.append(("step", self.step_count + 1))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(DrafterTrainer, "step", step)
    return events


def syncs_per_step(events: list[tuple[str, object]]) -> dict[int, list[object]]:
    per_step: dict[int, list[object]] = {}
    current = None
    for kind, value in events:
        if kind == "step":
            current = value
            per_step[current] = []
        elif current is not None:
            per_step[current].append(value)
    return per_step


@pytest.mark.parametrize("trainer", ["pipeline", "reference"])
@pytest.mark.usefixtures("tiny_target")
def test_no_host_sync_on_steps_that_are_not_logged(tmp_path, monkeypatch, trainer) -> None:
    cfg = small_cfg(tmp_path, steps=7, log_every=3)
    events = count_host_syncs(monkeypatch)
    train = pipeline.run_pipeline if trainer == "pipeline" else train_reference
    train(cfg, log=lambda _: None)
    per_step = syncs_per_step(events)
    assert sorted(per_step) == list(range(1, 8))
    logged = {1, 3, 6, 7}  # the first, every third, the last
    for step, syncs in per_step.items():
        if step in logged:
            assert len(syncs) >= 1, step  # the one read of the step's figures
        else:
            assert syncs == [], (step, syncs)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == sorted(logged)
    for record in records:
        assert len(record["accuracy_per_position"]) == cfg.drafter.block_size - 1
        assert record["tau_estimate"] == pytest.approx(
            tau_estimate(record["accuracy_per_position"])
        )
        assert record["loss"] > 0 and record["grad_norm"] >= 0 and record["lr"] > 0


def test_tau_estimate_is_the_expected_accepted_length_plus_one() -> None:
    assert tau_estimate([]) == 1.0
    assert tau_estimate([1.0, 1.0, 1.0]) == 4.0
    assert tau_estimate([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert tau_estimate([0.0, 1.0]) == 1.0
