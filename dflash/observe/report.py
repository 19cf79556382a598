"""`report RUN_DIR`: one self-contained report.html that shows a run to a person.

Files read from RUN_DIR (written by `dflash-train train`):
    summary.json    required: figures, evaluation (τ, acceptance per block position)
    config.json     required: the resolved configuration
    metrics.jsonl   optional: one JSON object per logged step (step, loss, tau, lr,
                    grad_norm, accuracy per position, time_s, tokens_per_s per stage)
    stats.json      optional: the cumulative ProfileStats snapshot (phase table, verdict)
    timeline.json   optional: the Chrome trace-event timeline (or where summary.json's
                    telemetry.files.timeline says `--timeline` wrote it)
The page needs no network: charts are inline SVG, styles inline, no external asset.
"""

from __future__ import annotations

import json
import time
from html import escape
from pathlib import Path
from typing import Any

from dflash.errors import DFlashError, first_line
from dflash.files import special_file, unwritable, write_text_atomic
from dflash.observe.bottleneck import snapshot_verdict
from dflash.observe.report_svg import Slice, bar_chart, line_chart, timeline_chart
from dflash.summary import JSON, Summary
from tracing import StatsSnapshot

REQUIRED = ("summary.json", "config.json")
TIMELINE_BATCHES = 4


class ReportError(DFlashError):
    """RUN_DIR is not a run directory, or one of its files is unreadable (one line)."""


def _regular(path: Path) -> Path:
    """`path`, unless it is a FIFO, a device or a socket: reading a FIFO waits for a
    writer that may never come."""
    kind = special_file(path)
    if kind is not None:
        raise ReportError(f"report: {path} is {kind}, not a regular file: a run writes files")
    return path


def _load_json(path: Path) -> Any:  # Any: a JSON value, of the type the file holds
    _regular(path)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"report: cannot read {path}: {exc}") from None


def read_metrics(path: Path) -> list[JSON]:
    if not path.exists():
        return []
    _regular(path)
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise ReportError(f"report: {path} line {number} is not JSON") from None
    return rows


def _series(rows: list[JSON], *keys: str) -> list[tuple[float, float]]:
    out = []
    for row in rows:
        value = next((row[k] for k in keys if isinstance(row.get(k), (int, float))), None)
        if value is not None and isinstance(row.get("step"), (int, float)):
            out.append((float(row["step"]), float(value)))
    return out


def _stage_rates(rows: list[JSON]) -> dict[str, list[tuple[float, float]]]:
    """tokens/s per stage over time from metrics.jsonl (`tokens_per_s` by stage)."""
    stages: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        rates = row.get("tokens_per_s")
        when = row.get("time_s", row.get("step"))
        if isinstance(rates, dict) and isinstance(when, (int, float)):
            for stage, value in rates.items():
                stages.setdefault(stage, []).append((float(when), float(value)))
    return stages


def _timeline_rates(doc: JSON) -> dict[str, list[tuple[float, float]]]:
    """The same from the timeline's `tokens/s` counter track, when metrics lack it."""
    stages: dict[str, list[tuple[float, float]]] = {}
    for event in doc.get("traceEvents", []):
        if event.get("ph") == "C" and event.get("name") == "tokens/s":
            for stage, value in event.get("args", {}).items():
                stages.setdefault(stage, []).append((event["ts"] / 1e6, float(value)))
    return stages


def timeline_slices(doc: JSON, num_batches: int = TIMELINE_BATCHES) -> list[Slice]:
    """The phase slices of a few consecutive batches in the middle of the run, with
    every slice of any thread that overlaps them in time."""
    events = doc.get("traceEvents", [])
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X"]
    batches = sorted({e["args"]["batch"] for e in slices if "batch" in e.get("args", {})})
    if not batches:
        chosen = slices[:50]
    else:
        middle = max(0, len(batches) // 2 - num_batches // 2)
        keep = set(batches[middle : middle + num_batches])
        ours = [e for e in slices if e.get("args", {}).get("batch") in keep]
        t0 = min(e["ts"] for e in ours)
        t1 = max(e["ts"] + e["dur"] for e in ours)
        chosen = [e for e in slices if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    return [_slice(e, names) for e in chosen]


def _slice(event: JSON, thread_names: dict[object, str]) -> Slice:
    """One complete ("X") trace event as a timeline slice (times in seconds)."""
    thread = thread_names.get(event["tid"], str(event["tid"]))
    phase, start, duration = event["name"], event["ts"] / 1e6, event["dur"] / 1e6
    return thread, phase, start, duration, event.get("args", {}).get("batch")


def phase_table(snap: StatsSnapshot) -> str:
    rows = []
    for name, stats in sorted(snap.phases.items(), key=lambda kv: -kv[1].total_s):
        share = snap.share(name)
        rows.append(
            f'<tr data-phase="{escape(name)}"><td>{escape(name)}</td><td>{stats.count}</td>'
            f"<td>{stats.total_s:.3f}</td><td>{stats.mean_s * 1e3:.3f}</td>"
            f"<td>{stats.p50_s * 1e3:.3f}</td><td>{stats.p95_s * 1e3:.3f}</td>"
            f"<td>{stats.max_s * 1e3:.3f}</td>"
            f'<td data-share="{"" if share is None else f"{share:.4f}"}">'
            f"{'' if share is None else f'{100 * share:.1f}%'}</td></tr>"
        )
    columns = ("phase", "count", "total s", "mean ms", "p50 ms", "p95 ms", "max ms", "share")
    head = "<tr>" + "".join(f"<th>{column}</th>" for column in columns) + "</tr>"
    return f'<table id="phases">{head}{"".join(rows)}</table>'


def _verdict(summary: Summary, snap: StatsSnapshot | None) -> str | None:
    if summary.verdict is not None:
        return summary.verdict
    if snap is None:
        return None
    return snapshot_verdict(snap)


def _timeline_path(run_dir: Path, summary: Summary) -> Path:
    """The run's timeline: where training wrote it (`--timeline`), else the default."""
    written = summary.timeline_file
    if written is not None and Path(written).is_file():
        return Path(written)
    return run_dir / "timeline.json"


def render(run_dir: Path) -> str:
    missing = [name for name in REQUIRED if not (run_dir / name).is_file()]
    if missing:
        raise ReportError(
            f"report: {run_dir} is not a run directory: {', '.join(missing)} missing "
            "(written at the end of `dflash-train train`)"
        )
    summary = Summary.from_dict(_load_json(run_dir / "summary.json"))
    rows = read_metrics(run_dir / "metrics.jsonl")
    stats_path = run_dir / "stats.json"
    snap = StatsSnapshot.from_dict(_load_json(stats_path)) if stats_path.exists() else None
    timeline_path = _timeline_path(run_dir, summary)
    doc = _load_json(timeline_path) if timeline_path.exists() else {}
    acceptance = summary.acceptance_per_position
    rates = _stage_rates(rows) or _timeline_rates(doc)
    charts = [
        line_chart("loss", "Training loss", {"loss": _series(rows, "loss")}, "step", "loss"),
        line_chart(
            "tau",
            "τ (acceptance length): held-out decoding and training's estimates",
            {
                "held-out τ (decoded)": _series(rows, "eval_tau"),
                "held-out τ (serving walk)": _series(rows, "walk_tau"),
                "training τ, per-block chain": _series(rows, "tau_chain"),
                "training τ, positions independent": _series(rows, "tau", "tau_estimate"),
            },
            "step",
            "τ, tokens per cycle",
        ),
        bar_chart(
            "acceptance",
            f"Acceptance per block position (τ {_tau_text(summary.tau)})",
            [str(k + 1) for k in range(len(acceptance))],
            acceptance,
            "block position",
            "share of cycles accepting it",
            y_max=1.0,
        ),
        line_chart("tokens", "Tokens per second per stage", rates, "time, s", "tokens/s"),
        timeline_chart(
            "timeline",
            f"Timeline of {TIMELINE_BATCHES} batches across threads",
            timeline_slices(doc) if doc else [],
        ),
    ]
    verdict = _verdict(summary, snap)
    notes = "".join(f"<li>{escape(note)}</li>" for note in tau_notes(summary))
    return PAGE.format(
        title=escape(f"dflash-train run {run_dir.name}"),
        made=time.strftime("%Y-%m-%d %H:%M"),
        headline=headline(summary, verdict),
        details=details_table(summary),
        notes=f'<ul class="notes">{notes}</ul>' if notes else "",
        charts="".join(f'<section class="card chart-card">{c}</section>' for c in charts),
        phases=phase_table(snap) if snap else "<p>no phase statistics recorded (stats.json)</p>",
        css=CSS,
    )


def _tile(name: str, label: str, value: str, detail: str = "") -> str:
    """One figure of the headline: its label, its value (with unit), a line under it."""
    under = f'<div class="detail">{escape(detail)}</div>' if detail else ""
    return (
        f'<div class="tile" data-figure="{name}"><div class="label">{escape(label)}</div>'
        f'<div class="value">{escape(value)}</div>{under}</div>'
    )


def headline(summary: Summary, verdict: str | None) -> str:
    """The card a person reads first: τ, τ without repeats, speedup, tokens/s, verdict."""
    evaluation = summary.evaluation
    tau, pooled = summary.tau, summary.tau_pooled
    if tau is None:
        why = evaluation.skipped or "no final evaluation"
        tau_tile = _tile("tau", "τ on held-out prompts", "not evaluated", why)
    else:
        engine = "served by vLLM" if evaluation.served is not None else "decoded in process"
        pooled_text = f"pooled {pooled:.2f}, " if pooled is not None else ""
        tau_tile = _tile("tau", "τ on held-out prompts", f"{tau:.2f}", pooled_text + engine)
    share, without = evaluation.repeated_share, evaluation.tau_without_repeats
    if without is None:
        repeats = _tile("tau-without-repeats", "τ without repeats", "n/a", "not measured")
    else:
        detail = "" if share is None else f"{share:.0%} of accepted drafts in repeated spans"
        repeats = _tile("tau-without-repeats", "τ without repeats", f"{without:.2f}", detail)
    speedup = summary.speedup
    speed_tile = _tile(
        "speedup",
        "Speedup",
        "n/a" if speedup is None else f"{speedup:.2f}×",
        "vs greedy decoding, same target" if speedup is not None else "not measured",
    )
    rate = summary.tokens_per_s
    rate_tile = _tile(
        "tokens-per-s",
        "Training speed",
        "n/a" if rate is None else f"{rate:,.0f} tokens/s",
        "" if summary.train_s is None else f"over {_duration(summary.train_s)} of training",
    )
    said = verdict or "no phase statistics recorded (stats.json)"
    verdict_tile = (
        '<div class="tile verdict-tile" data-figure="verdict"><div class="label">Bottleneck '
        f'verdict</div><div id="verdict">{escape(said)}</div></div>'
    )
    tiles = tau_tile + repeats + speed_tile + rate_tile + verdict_tile
    return f'<section class="card" id="headline">{tiles}</section>'


def details_table(summary: Summary) -> str:
    """The run's other figures, one labelled row each (a row only for what is known)."""
    rows: list[tuple[str, str | None]] = [
        ("Steps", None if summary.steps is None else f"{summary.steps:,}"),
        ("Final loss", None if summary.final_loss is None else f"{summary.final_loss:.3f}"),
        (
            "Training's τ estimate (last logged step)",
            None if summary.tau_estimate is None else f"{summary.tau_estimate:.2f}",
        ),
        ("Block size", None if summary.block_size is None else str(summary.block_size)),
        ("Training time", None if summary.train_s is None else _duration(summary.train_s)),
        ("Wall time", None if summary.wall_s is None else _duration(summary.wall_s)),
        ("Target", summary.target),
        ("Stopped by", summary.interrupted),
    ]
    body = "".join(
        f"<tr><th>{escape(label)}</th><td>{escape(value)}</td></tr>"
        for label, value in rows
        if value is not None
    )
    return f'<table id="figures">{body}</table>'


def _duration(seconds: float) -> str:
    """Seconds for a reader: 12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def tau_notes(summary: Summary | JSON) -> list[str]:
    """What τ on held-out is made of, beside it in the summary and the report: the share
    of accepted drafts inside repeated spans, and the training estimate against it."""
    if not isinstance(summary, Summary):
        summary = Summary.from_dict(summary)
    notes = []
    tau, served = summary.tau, summary.evaluation.served
    if served is not None:
        notes.append(
            f"τ measured by the serving engine ({served.server}): its own counters over "
            f"{served.requests} held-out prompts, {served.num_drafts} drafts "
            f"of {served.num_speculative_tokens} tokens"
        )
    share = summary.evaluation.repeated_share
    if share is not None:
        without = summary.evaluation.tau_without_repeats
        notes.append(
            f"{share:.0%} of accepted drafts are inside repeated spans of "
            "the output; pooled τ without them "
            + (f"{without:.3f}" if without is not None else "n/a")
        )
    estimate = summary.tau_estimate
    if estimate is not None and tau is not None:
        notes.append(
            f"training's τ estimate {estimate:.2f} vs evaluation τ {tau:.3f}: the estimate "
            "scores random anchors of training rows against the data's next tokens; "
            "evaluation decodes held-out prompts, where the target's own greedy loops are "
            "easy to draft"
        )
    return notes


def _tau_text(tau: float | None) -> str:
    return f"{tau:.3f}" if tau is not None else "not evaluated"


def write_report(run_dir: str | Path) -> Path:
    """Writes RUN_DIR/report.html and returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"report: {run_dir} is not a directory")
    out = run_dir / "report.html"
    why = unwritable(out)
    if why is not None:
        raise ReportError(f"report: {out} cannot be written: {why}")
    try:
        page = render(run_dir)
    except ReportError:
        raise
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:
        # A file of the folder is JSON, but not what a run writes (edited, or another tool's).
        raise ReportError(
            f"report: the files of {run_dir} are not a dflash-train run's "
            f"(summary.json, stats.json, metrics.jsonl, timeline.json): {first_line(exc)}"
        ) from None
    try:
        write_text_atomic(out, page)
    except OSError as exc:
        raise ReportError(f"report: cannot write {out}: {exc.strerror}") from None
    return out


CSS = """
body{font:15px system-ui,sans-serif;margin:24px auto;max-width:1200px;padding:0 16px;
color:#222;background:#fafafa}
h1{font-size:22px}h2{font-size:17px}.made{color:#777}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:12px;margin:12px 0}
#headline{display:flex;flex-wrap:wrap;gap:12px}
.tile{flex:1 1 170px;padding:6px 10px;border-left:3px solid #1f77b4}
.tile .label{font-size:13px;color:#555}.tile .value{font-size:28px;font-weight:600}
.tile .detail{font-size:13px;color:#555}
.verdict-tile{flex:2 1 360px;border-left-color:#e0a800}#verdict{font-weight:600;padding-top:4px}
table{border-collapse:collapse}td,th{padding:3px 10px;text-align:right;border-bottom:1px solid #eee}
th:first-child,td:first-child{text-align:left}#figures th{font-weight:normal;color:#555}
.notes{margin:8px 0 0;padding-left:20px;color:#444}.notes li{margin:4px 0}
.chart-card svg{display:block;width:100%;height:auto}
svg .title{font-size:14px;font-weight:600}svg .plot{fill:#fff;stroke:#999}
svg .grid{stroke:#eee}svg .ytick{font-size:11px;text-anchor:end}
svg .xtick,svg .barvalue{font-size:11px;text-anchor:middle}
svg .xlabel,svg .ylabel{font-size:12px;text-anchor:middle;fill:#444}
svg .legend{font-size:12px}svg .empty{font-size:13px;text-anchor:middle;fill:#999}
"""

# The script only records, after layout, that each chart and the headline have a drawn
# size: the tests read it back through the page (nothing draws by it).
PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{css}</style></head><body>
<h1>{title}</h1><p class="made">report written {made}</p>
{headline}
<section class="card"><h2>The run</h2>{details}{notes}</section>
<div>{charts}</div>
<section class="card"><h2>Phases</h2>{phases}</section>
<script>
window.addEventListener("load", function () {{
  document.querySelectorAll("svg.chart").forEach(function (svg) {{
    var box = svg.getBoundingClientRect();
    svg.setAttribute("data-drawn", Math.round(box.width) + "x" + Math.round(box.height));
  }});
  var top = document.getElementById("headline").getBoundingClientRect();
  var drawn = Math.round(top.width) + "x" + Math.round(top.height);
  document.body.setAttribute("data-headline", drawn);
  document.body.setAttribute("data-ready", "1");
}});
</script>
</body></html>
"""
