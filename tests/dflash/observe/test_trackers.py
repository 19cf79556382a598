"""--report-to without the tools: the option, the checks before any model loads, and
`Reporting`'s contract with stand-in trackers (order, counts, one line on a failure, a
bounded close). tests/integration/test_trackers.py runs the real tools."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dflash import cli as cli_mod
from dflash.config.settings import TelemetryConfig, TrainConfig
from dflash.observe import trackers
from dflash.observe.trackers import (
    Reporting,
    RunEnd,
    RunStart,
    TrackerError,
    check_installed,
    numeric_figures,
    summary_figures,
)


def invoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(cli_mod.cli, args, env=env, catch_exceptions=False)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    """Training replaced by recording the config the command line built."""
    seen: list[TrainConfig] = []
    monkeypatch.setattr("dflash.run.pipelined.run_training", lambda cfg, **_: seen.append(cfg))
    return seen


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


# ----------------------------------------------------------------- the option


def test_none_by_default() -> None:
    assert TelemetryConfig().report_to == ()
    assert TrainConfig().to_dict()["telemetry"]["report_to"] == []


def test_comma_separated_repeated_and_from_the_environment(captured, tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    args = ["train", "--output-dir", out, "--report-to", "tensorboard,mlflow"]
    result = invoke([*args, "--report-to", "wandb", "--report-to", "mlflow"])
    assert result.exit_code == 0, result.output
    assert captured[-1].telemetry.report_to == ("tensorboard", "mlflow", "wandb")
    result = invoke(["train", "--output-dir", out], env={"DFLASH_REPORT_TO": "wandb,tensorboard"})
    assert result.exit_code == 0, result.output
    assert captured[-1].telemetry.report_to == ("wandb", "tensorboard")
    config = tmp_path / "c.yaml"
    config.write_text("report_to: [mlflow]\n")
    result = invoke(["train", "--output-dir", out, "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert captured[-1].telemetry.report_to == ("mlflow",)
    # A flag overrides the file; `none` turns reporting off.
    result = invoke(["train", "--output-dir", out, "--config", str(config), "--report-to", "none"])
    assert result.exit_code == 0, result.output
    assert captured[-1].telemetry.report_to == ("none",)
    assert trackers.wanted(captured[-1].telemetry.report_to) == []


def test_the_help_says_it_is_repeatable_and_unset() -> None:
    result = invoke(["train", "--help"])
    text = " ".join(result.output.split())
    assert "--report-to" in text and "Comma-separated or repeated;" in text
    assert "(default: unset)" in text


@pytest.mark.parametrize(
    ("value", "named"), [("tensorbored", "'tensorbored'"), ("mlflow,comet", "'comet'")]
)
def test_an_unknown_tool_is_one_error_line_naming_it(captured, value: str, named: str) -> None:
    result = invoke(["train", "--report-to", value])
    assert result.exit_code == 2, result.output
    (line,) = error_lines(result.output)
    assert line.startswith(f"Error: --report-to '{value}' is invalid: unknown tool {named}")
    assert "tensorboard, mlflow, wandb" in line
    assert "Traceback" not in result.output and captured == []


def test_none_with_a_tool_is_one_error_line(captured) -> None:
    result = invoke(["train", "--report-to", "none", "--report-to", "mlflow"])
    assert result.exit_code == 2, result.output
    (line,) = error_lines(result.output)
    assert "none turns reporting off: give it alone" in line and captured == []


def test_an_unknown_tool_from_the_environment_names_the_variable(captured) -> None:
    result = invoke(["train"], env={"DFLASH_REPORT_TO": "neptune"})
    (line,) = error_lines(result.output)
    assert "(from DFLASH_REPORT_TO)" in line and "'neptune'" in line


def test_a_tool_not_installed_is_one_line_naming_the_package_before_any_model_loads(
    captured, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(
        trackers.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else real(name, *a),
    )
    out = tmp_path / "run"
    result = invoke(["train", "--output-dir", str(out), "--report-to", "tensorboard,wandb"])
    assert result.exit_code == 2, result.output
    (line,) = error_lines(result.output)
    assert "--report-to wandb: W&B's library is not installed: pip install wandb" in line
    assert "pip install 'dflash-train[trackers]'" in line
    assert captured == []  # training (and so every model load) never started
    assert not out.exists()  # the folder is left as it was found


def test_the_package_named_is_the_pinned_one_of_the_trackers_extra() -> None:
    pyproject = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    extra = next(line for line in pyproject.splitlines() if line.startswith("trackers = "))
    for tool in trackers.TOOLS.values():
        pin = trackers.pinned(tool.package)
        assert pin.startswith(tool.package)
        if pin != tool.package:  # dflash-train's metadata is installed (the checkout venv)
            assert f'"{pin}"' in extra, (pin, extra)


def test_check_installed_passes_for_what_is_importable_and_none() -> None:
    check_installed(["none"])
    check_installed([])
    with pytest.raises(TrackerError):
        original = trackers.TOOLS["mlflow"]
        try:
            trackers.TOOLS["mlflow"] = trackers.Tool("mlflow", "no_such_module_x", "mlflow-x", "M")
            check_installed(["mlflow"])
        finally:
            trackers.TOOLS["mlflow"] = original


# ----------------------------------------------------------------- the figures


def test_the_numeric_figures_of_a_metrics_line() -> None:
    line = {
        "step": 6,
        "loss": 2.5,
        "accuracy_per_position": [0.5, 0.25],
        "tokens_per_s": {"target": 100.0, "drafter": 50},
        "diverged_at_step": None,
        "bad_steps": 0,
        "note": "text",
        "flag": True,
    }
    assert numeric_figures(line) == {
        "loss": 2.5,
        "accuracy_per_position/0": 0.5,
        "accuracy_per_position/1": 0.25,
        "tokens_per_s/target": 100.0,
        "tokens_per_s/drafter": 50.0,
        "bad_steps": 0.0,
    }
    summary = {"tau": 3.5, "acceptance_per_position": [0.9], "pipeline": {"x": 1}, "target": "t"}
    assert summary_figures(summary) == {
        "summary/tau": 3.5,
        "summary/acceptance_per_position/0": 0.9,
    }


# ----------------------------------------------------------------- Reporting


class Recorder:
    """A stand-in tracker that records what it is given (and may fail or hang)."""

    def __init__(self, name: str = "rec", fail: bool = False, hang: threading.Event | None = None):
        self.name, self.fail, self.hang = name, fail, hang
        self.calls: list[tuple[str, Any]] = []

    def prepare(self) -> None:
        self.calls.append(("prepare", None))

    def begin(self, run: RunStart, say: Any) -> None:
        if self.fail:
            raise ConnectionError("connection refused (stand-in)")
        self.calls.append(("begin", run))

    def log_step(self, step: int, figures: dict[str, float]) -> None:
        if self.hang is not None:
            self.hang.wait()
        self.calls.append(("step", (step, dict(figures))))

    def finish(self, end: RunEnd) -> None:
        self.calls.append(("finish", end))

    def where(self) -> str:
        return "somewhere"


def reporting_with(*recorders: Recorder, lines: list[str]) -> Reporting:
    factories = {r.name: (lambda r=r: r) for r in recorders}
    return Reporting([r.name for r in recorders], lines.append, "run-1", factories)


def write_run(folder: Path, rows: list[dict[str, Any]], summary: dict[str, Any] | None) -> None:
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))


def test_each_line_in_order_then_the_amended_last_line_and_the_summary(tmp_path: Path) -> None:
    lines: list[str] = []
    rec = Recorder()
    reporting = reporting_with(rec, lines=lines)
    reporting.begin({"run": {"steps": 2}}, tmp_path, 0)
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "acc": [0.5]}]
    for row in rows:
        reporting.log_step(row)
    # The final evaluation joins the last line (dflash.train.step_metrics.amend_line).
    rows[-1] = {**rows[-1], "eval_tau": 1.5}
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    write_run(tmp_path, rows, {"steps": 2, "tau": 1.5, "drafter_dir": str(drafter)})
    reporting.close()
    kinds = [kind for kind, _ in rec.calls]
    assert kinds == ["prepare", "begin", "step", "step", "step", "finish"]
    start = rec.calls[1][1]
    assert start.config == {"run": {"steps": 2}} and start.run_id == "run-1"
    assert [args for kind, args in rec.calls if kind == "step"] == [
        (1, {"loss": 3.0}),
        (2, {"loss": 2.0, "acc/0": 0.5}),
        (2, {"eval_tau": 1.5}),  # only what the amended line added
    ]
    end = rec.calls[-1][1]
    assert end.status == "finished" and end.summary["tau"] == 1.5
    assert end.drafter_dir == drafter
    assert lines == ["report-to rec: 2 steps to somewhere"]


def test_an_interrupted_and_a_failed_run_say_so(tmp_path: Path) -> None:
    for summary, status in (
        ({"steps": 1, "interrupted": "SIGINT"}, "interrupted"),
        (None, "failed"),
    ):
        rec = Recorder()
        reporting = reporting_with(rec, lines=[])
        folder = tmp_path / status
        folder.mkdir()
        reporting.begin({}, folder)
        reporting.log_step({"step": 1, "loss": 1.0})
        write_run(folder, [{"step": 1, "loss": 1.0}], summary)
        reporting.close()
        assert rec.calls[-1][0] == "finish" and rec.calls[-1][1].status == status


def test_files_of_an_earlier_run_are_not_this_runs(tmp_path: Path) -> None:
    write_run(tmp_path, [{"step": 9, "loss": 1.0}], {"steps": 9})
    old = time.time() - 3600
    for name in ("metrics.jsonl", "summary.json"):
        import os

        os.utime(tmp_path / name, (old, old))
    rec = Recorder()
    reporting = reporting_with(rec, lines=[])
    reporting.begin({}, tmp_path)
    reporting.close()
    assert [k for k, _ in rec.calls] == ["prepare", "begin", "finish"]
    assert rec.calls[-1][1].status == "failed"


def test_a_run_refused_before_its_checks_tells_the_trackers_nothing(tmp_path: Path) -> None:
    lines: list[str] = []
    rec = Recorder()
    reporting = reporting_with(rec, lines=lines)
    reporting.close()
    assert [k for k, _ in rec.calls] in ([], ["prepare"]) and lines == []


def test_a_tool_that_fails_is_one_line_counted_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines: list[str] = []
    down, fine = Recorder("down", fail=True), Recorder("fine")
    reporting = reporting_with(down, fine, lines=lines)
    reporting.begin({}, tmp_path)
    started = time.monotonic()
    for step in range(1, 51):
        reporting.log_step({"step": step, "loss": 1.0 / step})
    assert time.monotonic() - started < 1.0  # the caller (training) never waits
    write_run(tmp_path, [{"step": 50, "loss": 0.02}], {"steps": 50})
    reporting.close()
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1, lines  # the first failure, once
    assert warnings[0].startswith(
        "warning: report-to down: somewhere failed (ConnectionError: connection refused "
    )
    assert "metrics.jsonl" in warnings[0]
    assert (
        "report-to down: 0 of 50 steps delivered to somewhere; the others are only in "
        "metrics.jsonl" in lines
    )  # the count, with every tool's closing line
    assert "report-to fine: 50 steps to somewhere" in lines
    assert len([k for k, _ in fine.calls if k == "step"]) == 50


def test_close_is_bounded_by_a_tool_that_stops_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trackers, "IDLE_BOUND_S", 0.5)
    lines: list[str] = []
    release = threading.Event()
    stuck = Recorder("stuck", hang=release)
    reporting = reporting_with(stuck, lines=lines)
    reporting.begin({}, tmp_path)
    for step in (1, 2, 3):
        reporting.log_step({"step": step, "loss": 1.0})
    write_run(tmp_path, [{"step": 3, "loss": 1.0}], {"steps": 3})
    started = time.monotonic()
    reporting.close()
    assert time.monotonic() - started < 3.0
    release.set()
    (line,) = lines
    assert line.startswith("warning: report-to stuck: 0 of 3 steps delivered")
    assert "no answer within the bound" in line


def test_a_full_queue_drops_and_counts_instead_of_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trackers, "QUEUE_ITEMS", 5)
    monkeypatch.setattr(trackers, "IDLE_BOUND_S", 0.5)
    release = threading.Event()
    lines: list[str] = []
    slow = Recorder("slow", hang=release)
    reporting = reporting_with(slow, lines=lines)
    reporting.begin({}, tmp_path)
    started = time.monotonic()
    for step in range(1, 101):
        reporting.log_step({"step": step, "loss": 1.0})
    assert time.monotonic() - started < 1.0
    release.set()
    write_run(tmp_path, [{"step": 100, "loss": 1.0}], {"steps": 100})
    reporting.close()
    (line,) = lines
    assert line.startswith("warning: report-to slow: ") and " of 100 steps delivered" in line


def test_ranks_other_than_0_report_nothing() -> None:
    reporting = trackers.start_reporting(["tensorboard"], "r", print, is_main=False)
    assert not reporting and reporting.span_exporters() == []
