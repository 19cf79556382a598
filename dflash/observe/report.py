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


def _load_json(path: Path) -> Any:
    _regular(path)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"report: cannot read {path}: {exc}") from None


def read_metrics(path: Path) -> list[dict[str, Any]]:
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


def _series(rows: list[dict[str, Any]], *keys: str) -> list[tuple[float, float]]:
    out = []
    for row in rows:
        value = next((row[k] for k in keys if isinstance(row.get(k), (int, float))), None)
        if value is not None and isinstance(row.get("step"), (int, float)):
            out.append((float(row["step"]), float(value)))
    return out


def _stage_rates(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """tokens/s per stage over time from metrics.jsonl (`tokens_per_s` by stage)."""
    stages: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        rates = row.get("tokens_per_s")
        when = row.get("time_s", row.get("step"))
        if isinstance(rates, dict) and isinstance(when, (int, float)):
            for stage, value in rates.items():
                stages.setdefault(stage, []).append((float(when), float(value)))
    return stages


def _timeline_rates(doc: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """The same from the timeline's `tokens/s` counter track, when metrics lack it."""
    stages: dict[str, list[tuple[float, float]]] = {}
    for event in doc.get("traceEvents", []):
        if event.get("ph") == "C" and event.get("name") == "tokens/s":
            for stage, value in event.get("args", {}).items():
                stages.setdefault(stage, []).append((event["ts"] / 1e6, float(value)))
    return stages


def timeline_slices(doc: dict[str, Any], num_batches: int = TIMELINE_BATCHES) -> list[Slice]:
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


def _slice(event: dict[str, Any], thread_names: dict[Any, str]) -> Slice:
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


def _verdict(summary: dict[str, Any], snap: StatsSnapshot | None) -> str | None:
    if isinstance(summary.get("verdict"), str):
        return summary["verdict"]
    if snap is None:
        return None
    return snapshot_verdict(snap)


def _timeline_path(run_dir: Path, summary: dict[str, Any]) -> Path:
    """The run's timeline: where training wrote it (`--timeline`), else the default."""
    files = (summary.get("telemetry") or {}).get("files") or {}
    written = files.get("timeline") if isinstance(files, dict) else None
    if isinstance(written, str) and Path(written).is_file():
        return Path(written)
    return run_dir / "timeline.json"


def render(run_dir: Path) -> str:
    missing = [name for name in REQUIRED if not (run_dir / name).is_file()]
    if missing:
        raise ReportError(
            f"report: {run_dir} is not a run directory: {', '.join(missing)} missing "
            "(written at the end of `dflash-train train`)"
        )
    summary = _load_json(run_dir / "summary.json")
    rows = read_metrics(run_dir / "metrics.jsonl")
    stats_path = run_dir / "stats.json"
    snap = StatsSnapshot.from_dict(_load_json(stats_path)) if stats_path.exists() else None
    timeline_path = _timeline_path(run_dir, summary)
    doc = _load_json(timeline_path) if timeline_path.exists() else {}
    acceptance = list(summary.get("acceptance_per_position") or [])
    rates = _stage_rates(rows) or _timeline_rates(doc)
    charts = [
        line_chart("loss", "Training loss", {"loss": _series(rows, "loss")}, "step"),
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
        ),
        bar_chart(
            "acceptance",
            f"Acceptance per block position (τ {_tau_text(summary.get('tau'))})",
            [str(k + 1) for k in range(len(acceptance))],
            acceptance,
            "block position",
            y_max=1.0,
        ),
        line_chart("tokens", "Tokens per second per stage", rates, "time s"),
        timeline_chart(
            "timeline",
            f"Timeline of {TIMELINE_BATCHES} batches across threads",
            timeline_slices(doc) if doc else [],
        ),
    ]
    verdict = _verdict(summary, snap)
    tau_keys = ("tau", "tau_pooled", "tau_without_repeats", "repeated_share", "tau_estimate")
    keys = ("steps", "final_loss", *tau_keys, "tokens_per_s", "train_s", "wall_s", "target")
    figures = "".join(
        f"<tr><th>{escape(k)}</th><td>{escape(_show(summary[k]))}</td></tr>"
        for k in keys
        if k in summary
    ) + "".join(f'<tr><th>τ</th><td class="note">{escape(n)}</td></tr>' for n in tau_notes(summary))
    return PAGE.format(
        title=escape(f"dflash-train run {run_dir.name}"),
        made=time.strftime("%Y-%m-%d %H:%M"),
        figures=figures,
        verdict=escape(verdict or "no phase statistics recorded (stats.json)"),
        charts="".join(f'<section class="card">{c}</section>' for c in charts),
        phases=phase_table(snap) if snap else "<p>no phase statistics recorded (stats.json)</p>",
        css=CSS,
    )


def tau_notes(summary: dict[str, Any]) -> list[str]:
    """What τ on held-out is made of, beside it in the summary and the report: the share
    of accepted drafts inside repeated spans, and the training estimate against it."""
    notes = []
    tau = summary.get("tau")
    served = summary.get("served")
    if isinstance(served, dict):
        notes.append(
            f"τ measured by the serving engine ({served.get('server')}): its own counters over "
            f"{served.get('requests')} held-out prompts, {served.get('num_drafts')} drafts "
            f"of {served.get('num_speculative_tokens')} tokens"
        )
    if isinstance(summary.get("repeated_share"), float):
        without = summary.get("tau_without_repeats")
        notes.append(
            f"{summary['repeated_share']:.0%} of accepted drafts are inside repeated spans of "
            "the output; pooled τ without them "
            + (f"{without:.3f}" if isinstance(without, float) else "n/a")
        )
    estimate = summary.get("tau_estimate")
    if isinstance(estimate, float) and isinstance(tau, float):
        notes.append(
            f"training's τ estimate {estimate:.2f} vs evaluation τ {tau:.3f}: the estimate "
            "scores random anchors of training rows against the data's next tokens; "
            "evaluation decodes held-out prompts, where the target's own greedy loops are "
            "easy to draft"
        )
    return notes


def _tau_text(tau: Any) -> str:
    return f"{tau:.3f}" if isinstance(tau, (int, float)) else "not evaluated"


def _show(value: Any) -> str:
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


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
body{font:14px system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px}.card{background:#fff;border:1px solid #ddd;border-radius:6px;
padding:8px;margin:8px;display:inline-block;vertical-align:top}
table{border-collapse:collapse}td,th{padding:2px 8px;text-align:right;border-bottom:1px solid #eee}
th:first-child,td:first-child{text-align:left}#verdict{font-weight:600;padding:8px;
background:#fff3cd;border-radius:6px;display:inline-block}
svg .title{font-size:13px;font-weight:600}svg .plot{fill:#fff;stroke:#999}
svg .grid{stroke:#eee}svg .ytick{font-size:10px;text-anchor:end}
svg .xtick,svg .barvalue{font-size:10px;text-anchor:middle}
svg .xlabel{font-size:10px;text-anchor:end}
svg .legend{font-size:11px}svg .empty{font-size:12px;text-anchor:middle;fill:#999}
"""

# The script only records, after layout, that each chart has a drawn size: the test
# reads it back through the page (the charts draw without it).
PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{css}</style></head><body>
<h1>{title}</h1><p>report written {made}</p>
<section class="card"><table id="figures">{figures}</table></section>
<section class="card"><div>bottleneck verdict</div><div id="verdict">{verdict}</div></section>
<div>{charts}</div>
<section class="card"><h2>Phases</h2>{phases}</section>
<script>
window.addEventListener("load", function () {{
  document.querySelectorAll("svg.chart").forEach(function (svg) {{
    var box = svg.getBoundingClientRect();
    svg.setAttribute("data-drawn", Math.round(box.width) + "x" + Math.round(box.height));
  }});
  document.body.setAttribute("data-ready", "1");
}});
</script>
</body></html>
"""
