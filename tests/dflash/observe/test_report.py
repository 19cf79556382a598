"""report.html: what it reads, what a missing file says, and what headless Chromium draws.

The run directory is built from the real pieces: a Timeline and ProfileStats fed by a
small three-thread pipeline through `tracing`, metrics.jsonl in the trainer's format.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import tracing
from dflash.observe.report import ReportError, write_report
from dflash.observe.timeline import Timeline
from tests.chromium import headless

NUM_STEPS = 20
ACCEPTANCE = [0.61, 0.42, 0.25, 0.12, 0.05, 0.02, 0.0]


def small_pipeline(num_batches: int) -> None:
    batch_q: queue.Queue[Any] = queue.Queue(maxsize=2)
    hs_q: queue.Queue[Any] = queue.Queue(maxsize=2)

    def prefetch() -> None:
        for _ in range(num_batches):
            batch_q.put(tracing.start_span("batch"))
        batch_q.put(None)

    def target() -> None:
        while (root := batch_q.get()) is not None:
            with tracing.phase("batch_queue.wait", parent=root):
                pass
            with tracing.phase("target.forward", parent=root):
                time.sleep(0.002)
            hs_q.put(root)
        hs_q.put(None)

    def drafter() -> None:
        while (root := hs_q.get()) is not None:
            with tracing.phase("hs_queue.wait", parent=root):
                pass
            with tracing.phase("drafter.step", parent=root), tracing.phase("drafter.loss"):
                time.sleep(0.003)
            root.end()

    threads = [threading.Thread(target=f, name=f.__name__) for f in (prefetch, target, drafter)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("run")
    timeline = Timeline(run / "timeline.json")
    telemetry = tracing.setup(tracing.TracingConfig(level="off"), phase_hooks=[timeline])
    tokens = {"target": 0.0, "drafter": 0.0}
    timeline.watch_rate("tokens/s", {k: (lambda k=k: tokens[k]) for k in tokens})
    try:
        for _ in range(3):
            small_pipeline(4)
            tokens["target"] += 2048
            tokens["drafter"] += 2048
            timeline.sample()
        (run / "stats.json").write_text(json.dumps(telemetry.stats.snapshot().to_dict()))
    finally:
        telemetry.shutdown(timeout_s=1.0)
    timeline.close()
    rows = []
    for s in range(1, NUM_STEPS + 1):
        rates = {"target": 16000.0 + s, "drafter": 15000.0 + s}
        row = {"step": s, "loss": 5.0 / s**0.5, "tau": 1.0 + s / 40, "lr": 1e-3, "grad_norm": 0.9}
        rows.append({**row, "accuracy": [0.5, 0.3], "time_s": 0.1 * s, "tokens_per_s": rates})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"steps": NUM_STEPS, "final_loss": rows[-1]["loss"], "tau": 1.34, "tau_pooled": 1.3}
    summary |= {"repeated_share": 0.25, "tau_without_repeats": 1.21, "tau_estimate": 1.5}
    summary |= {"acceptance_per_position": ACCEPTANCE, "tokens_per_s": 16687.5}
    summary |= {"train_s": 0.61, "wall_s": 1.9, "target": "builtin:tiny", "speedup": 1.42}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "config.json").write_text("{}")
    return run


def test_report_on_a_folder_that_is_not_a_run_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ReportError) as info:
        write_report(tmp_path)
    assert "summary.json missing" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ReportError, match="not a directory"):
        write_report(tmp_path / "nope")


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (
            lambda run: (run / "report.html").mkdir(),
            "report.html cannot be written: it is a folder",
        ),
        (lambda run: (run / "summary.json").write_text("[1, 2]"), "not a dflash-train run's"),
        (lambda run: (run / "stats.json").write_text('{"phases": 3}'), "not a dflash-train run's"),
        (lambda run: (run / "metrics.jsonl").write_text('[{"step": 1}]\n'), "not a dflash-train"),
    ],
)
def test_a_run_folder_of_the_wrong_shape_is_one_line(
    run_dir: Path, tmp_path: Path, damage, fragment
) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "report.html").unlink(missing_ok=True)
    damage(copy)
    with pytest.raises(ReportError, match=re.escape(fragment)) as info:
        write_report(copy)
    assert "\n" not in str(info.value)


def test_report_is_self_contained(run_dir: Path) -> None:
    html = write_report(run_dir).read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert html.count('class="chart"') == 5


def test_the_training_estimate_and_evaluation_tau_stand_side_by_side(run_dir: Path) -> None:
    text = write_report(run_dir).read_text().replace("&#x27;", "'")
    assert (
        "25% of accepted drafts are inside repeated spans of the output; pooled τ "
        "without them 1.210" in text
    )
    assert "training's τ estimate 1.50 vs evaluation τ 1.340: the estimate scores" in text


class DomReader(HTMLParser):
    """Elements of interest from Chromium's serialized DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict[str, str]] = {}
        self.marks: list[tuple[str, str, dict[str, str]]] = []  # chart, tag, attributes
        self.body: dict[str, str] = {}
        self.phase_rows: dict[str, str] = {}
        self.text: list[str] = []
        self._chart = self._row = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "svg" and "chart" in a.get("class", ""):
            self._chart = a["data-chart"]
            self.charts[self._chart] = a
        elif tag in ("circle", "rect", "polyline") and self._chart:
            self.marks.append((self._chart, tag, a))
        elif tag == "body":
            self.body = a
        elif tag == "tr" and "data-phase" in a:
            self._row = a["data-phase"]
        elif tag == "td" and "data-share" in a:
            self.phase_rows[self._row] = a["data-share"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._chart = ""

    def handle_data(self, data: str) -> None:
        if data.strip():
            self.text.append(data.strip())

    def values(self, chart: str, tag: str, key: str, **match: str) -> list[float]:
        marks = [a for c, t, a in self.marks if c == chart and t == tag and key in a]
        return [float(a[key]) for a in marks if all(a.get(k) == v for k, v in match.items())]


def test_chromium_draws_every_chart_with_the_run_numbers(run_dir: Path) -> None:
    path = write_report(run_dir)
    started = time.monotonic()
    done = headless("--dump-dom", path.as_uri())
    load_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    dom = DomReader()
    dom.feed(done.stdout)
    assert dom.body.get("data-ready") == "1", "the page's load handler did not run"
    assert set(dom.charts) == {"loss", "tau", "acceptance", "tokens", "timeline"}
    for name, chart in dom.charts.items():
        width, height = (int(v) for v in chart["data-drawn"].split("x"))
        assert width > 300 and height > 100, (name, chart["data-drawn"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert dom.values("loss", "circle", "data-y") == pytest.approx(
        [r["loss"] for r in rows], rel=1e-5
    )
    assert dom.values("tau", "circle", "data-y") == pytest.approx(
        [r["tau"] for r in rows], rel=1e-5
    )
    assert dom.values("acceptance", "rect", "data-value") == ACCEPTANCE
    drafter = dom.values("tokens", "circle", "data-y", **{"data-series": "drafter"})
    assert drafter == [r["tokens_per_s"]["drafter"] for r in rows]
    threads = {a.get("data-thread") for c, t, a in dom.marks if c == "timeline" and t == "rect"}
    assert {"prefetch", "target", "drafter"} <= threads
    phases = {a.get("data-phase") for c, t, a in dom.marks if c == "timeline" and t == "rect"}
    assert {"target.forward", "drafter.step", "drafter.loss", "batch"} <= phases
    stats = json.loads((run_dir / "stats.json").read_text())
    assert set(dom.phase_rows) == set(stats["phases"])
    assert float(dom.phase_rows["drafter.step"]) > 0
    assert any(t.startswith(("drafters waited", "targets waited", "balanced")) for t in dom.text)
    print(f"report: {path.stat().st_size / 1e3:.0f} kB, dump-dom in {load_s:.2f} s")
    assert path.stat().st_size < 2_000_000


def test_screenshot_for_the_readme(run_dir: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    done = headless(
        f"--screenshot={shot}", "--window-size=1400,1100", write_report(run_dir).as_uri()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # not a blank page
    target = os.environ.get("DFLASH_REPORT_SCREENSHOT")
    if target:  # docs/report.png is refreshed with DFLASH_REPORT_SCREENSHOT=docs/report.png
        shutil.copyfile(shot, target)


# summary.json's keys, which a person reading the page should never meet as text.
RAW_KEYS = (
    "tau_pooled",
    "repeated_share",
    "tau_without_repeats",
    "tokens_per_s",
    "tau_estimate",
    "final_loss",
    "train_s",
    "wall_s",
)


def test_the_headline_is_labelled_figures_a_person_reads(run_dir: Path, tmp_path: Path) -> None:
    """Through headless Chromium: the headline's labels and formatted numbers are drawn
    text, no raw summary key or exponent notation is, and no row is a bare `τ`."""
    path = write_report(run_dir)
    done = headless("--dump-dom", "--window-size=1400,1100", path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = DomReader()
    dom.feed(done.stdout)
    assert dom.body.get("data-ready") == "1", "the page's load handler did not run"
    width, height = (int(v) for v in dom.body["data-headline"].split("x"))
    assert width > 800 and height > 60, dom.body["data-headline"]  # drawn, page-wide
    text = dom.text
    for label in ("τ on held-out prompts", "τ without repeats", "Speedup", "Training speed"):
        assert label in text, label
    assert "Bottleneck verdict" in text
    assert {"1.34", "pooled 1.30, decoded in process", "1.21", "1.42×"} <= set(text)
    assert "25% of accepted drafts in repeated spans" in text
    assert "16,688 tokens/s" in text
    assert {"Steps", "Final loss", "Training time"} <= set(text)
    page = " ".join(text)
    assert not [key for key in RAW_KEYS if key in page]
    assert not re.search(r"\d\.?\d*e[+-]\d", page), "a number in exponent notation"
    assert "τ" not in text  # no row labelled with τ alone
    shot = tmp_path / "headline.png"
    done = headless(f"--screenshot={shot}", "--window-size=1400,700", path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
