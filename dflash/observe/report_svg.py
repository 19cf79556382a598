"""Inline SVG charts for the run report: line charts, bar charts and a thread timeline.

Every chart is an <svg class="chart" data-chart=NAME> whose marks carry their numbers
(`data-x`, `data-y`, `data-value`), so a test can read back through the rendered page
what was drawn. No script is needed to draw anything. The report's style stretches each
chart to the page's width (the viewBox keeps its proportions); both axes are labelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from html import escape

WIDTH, HEIGHT = 960, 300
LEFT, RIGHT, TOP, BOTTOM = 76, 16, 30, 50
_TAB10 = "1f77b4 ff7f0e 2ca02c d62728 9467bd 8c564b e377c2 7f7f7f bcbd22 17becf"
COLORS = tuple(f"#{rgb}" for rgb in _TAB10.split())  # matplotlib's tab10 palette
Point = tuple[float, float]
_EMPTY = f'<text x="{WIDTH // 2}" y="{HEIGHT // 2}" class="empty">{{text}}</text>'


def _fmt(value: float) -> str:
    """A number as a person reads it: 21,360 rather than 2.136e+04."""
    if value == 0:
        return "0"
    if abs(value) >= 1e4:
        return f"{value:,.0f}"
    if abs(value) < 1e-2:
        return f"{value:.2g}"
    return f"{value:.4g}"


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        high = low + 1.0
    step = 10 ** math.floor(math.log10((high - low) / count))
    for factor in (1, 2, 5, 10):
        if (high - low) / (step * factor) <= count:
            step *= factor
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _text(x: object, y: object, css_class: str, content: str) -> str:
    """A <text> mark at (x, y): numbers as given, or strings already formatted."""
    return f'<text x="{x}" y="{y}" class="{css_class}">{content}</text>'


def _frame(name: str, title: str, body: str, legend: Sequence[str] = ()) -> str:
    items = "".join(
        f'<tspan fill="{COLORS[i % len(COLORS)]}">■ {escape(label)} </tspan>'
        for i, label in enumerate(legend)
    )
    if len(legend) > 2:  # a long legend gets a line of its own, under the plot
        body += f'<text x="{LEFT}" y="{HEIGHT - 3}" class="legend">{items}</text>'
        items = ""
    return (
        f'<svg class="chart" data-chart="{escape(name)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(title)}</title>"
        f'<text x="{LEFT}" y="16" class="title">{escape(title)} {items}</text>{body}</svg>'
    )


def _axes(
    x_range: Point, y_range: Point, x_label: str, y_label: str, x_ticks: bool = True
) -> tuple[str, Callable[[float], float], Callable[[float], float]]:
    (x0, x1), (y0, y1) = x_range, y_range
    if x1 <= x0:
        x1 = x0 + 1.0
    if y1 <= y0:
        y1 = y0 + 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return TOP + plot_h - (y - y0) / (y1 - y0) * plot_h

    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" class="plot"/>']
    for y in _ticks(y0, y1):
        at = f"{sy(y):.1f}"
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{at}" y2="{at}" class="grid"/>')
        parts.append(_text(LEFT - 4, f"{sy(y) + 4:.1f}", "ytick", _fmt(y)))
    for x in _ticks(x0, x1) if x_ticks else []:
        parts.append(_text(f"{sx(x):.1f}", HEIGHT - BOTTOM + 14, "xtick", _fmt(x)))
    parts.append(_text(LEFT + plot_w / 2, HEIGHT - BOTTOM + 31, "xlabel", escape(x_label)))
    middle = TOP + plot_h / 2
    parts.append(
        f'<text x="14" y="{middle:.1f}" class="ylabel" '
        f'transform="rotate(-90 14 {middle:.1f})">{escape(y_label)}</text>'
    )
    return "".join(parts), sx, sy


def line_chart(
    name: str, title: str, series: Mapping[str, Sequence[Point]], x_label: str, y_label: str
) -> str:
    """One polyline per series; each point also a circle carrying data-x/data-y."""
    points = [p for values in series.values() for p in values]
    if not points:
        return _frame(name, title, _EMPTY.format(text="no data"))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    low = min(0.0, min(ys)) if min(ys) >= 0 and min(ys) < 0.2 * max(ys) else min(ys)
    axes, sx, sy = _axes((min(xs), max(xs)), (low, max(ys)), x_label, y_label)
    body = [axes]
    for index, (label, values) in enumerate(series.items()):
        color = COLORS[index % len(COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        body.append(
            f'<polyline data-series="{escape(label)}" points="{path}" stroke="{color}" '
            'fill="none" stroke-width="1.8"/>'
        )
        circles = (
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{color}" '
            f'data-series="{escape(label)}" data-x="{x:g}" data-y="{y:g}"/>'
            for x, y in values
        )
        body.append("".join(circles))
    return _frame(name, title, "".join(body), list(series))


def bar_chart(
    name: str,
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    x_label: str,
    y_label: str,
    y_max: float | None = None,
) -> str:
    """Vertical bars, each with its value printed above it and in data-value."""
    if not values:
        return _frame(name, title, _EMPTY.format(text="no data"))
    top = y_max if y_max is not None else max(max(values), 1e-9)
    axes, _, sy = _axes((0, len(values)), (0.0, top), x_label, y_label, x_ticks=False)
    slot = (WIDTH - LEFT - RIGHT) / len(values)
    body = [axes]
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        x, y = LEFT + i * slot + slot * 0.15, sy(value)
        height = sy(0.0) - y
        body.append(
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{slot * 0.7:.1f}" '
            f'height="{max(height, 0.0):.1f}" fill="{COLORS[0]}" '
            f'data-label="{escape(label)}" data-value="{value:g}"/>'
        )
        middle = f"{x + slot * 0.35:.1f}"
        shown = f"{value:.2f}" if top <= 1.0 else _fmt(value)  # shares: two decimals
        body.append(_text(middle, f"{y - 3:.1f}", "barvalue", shown))
        body.append(_text(middle, HEIGHT - BOTTOM + 14, "xtick", escape(label)))
    return _frame(name, title, "".join(body))


Slice = tuple[str, str, float, float, int | None]  # thread, phase, start s, duration s, batch


def timeline_chart(name: str, title: str, slices: Sequence[Slice]) -> str:
    """One row per thread, one rectangle per phase slice (colored by phase)."""
    if not slices:
        return _frame(name, title, _EMPTY.format(text="no timeline recorded"))
    threads = list(dict.fromkeys(s[0] for s in slices))
    phases = list(dict.fromkeys(s[1] for s in slices))
    t0 = min(s[2] for s in slices)
    t1 = max(s[2] + s[3] for s in slices)
    left = 110
    row_h = (HEIGHT - TOP - BOTTOM - 12) / len(threads)
    scale = (WIDTH - left - RIGHT) / max(t1 - t0, 1e-9)
    depth = _depths(slices)
    levels = {t: 1 + max(depth[i] for i, s in enumerate(slices) if s[0] == t) for t in threads}
    body = []
    for row, thread in enumerate(threads):
        body.append(_text(left - 4, f"{TOP + (row + 0.6) * row_h:.1f}", "ytick", escape(thread)))
    for index, (thread, phase, start, duration, batch) in enumerate(slices):
        level_h = (row_h - 4) / levels[thread]  # nested phases stack downwards
        y = TOP + threads.index(thread) * row_h + 2 + depth[index] * level_h
        color = COLORS[phases.index(phase) % len(COLORS)]
        x, ms = left + (start - t0) * scale, duration * 1e3
        batch_id = "" if batch is None else batch
        body.append(
            f'<rect class="slice" x="{x:.2f}" y="{y:.1f}" width="{max(duration * scale, 0.5):.2f}" '
            f'height="{level_h - 1:.1f}" fill="{color}" data-thread="{escape(thread)}" '
            f'data-phase="{escape(phase)}" data-batch="{batch_id}" data-duration-ms="{ms:.3f}">'
            f"<title>{escape(phase)} {ms:.2f} ms</title></rect>"
        )
    shown = f"time: {(t1 - t0) * 1e3:.1f} ms shown, left to right"
    body.append(_text(left + (WIDTH - left - RIGHT) / 2, HEIGHT - 22, "xlabel", shown))
    return _frame(name, title, "".join(body), phases)


def _depths(slices: Sequence[Slice]) -> list[int]:
    """Nesting depth of each slice within its thread (0: outermost)."""
    depth = [0] * len(slices)
    open_ends: dict[str, list[float]] = {}
    order = sorted(range(len(slices)), key=lambda i: (slices[i][2], -slices[i][3]))
    for i in order:
        thread, _, start, duration, _ = slices[i]
        stack = open_ends.setdefault(thread, [])
        while stack and stack[-1] <= start + 1e-9:
            stack.pop()
        depth[i] = len(stack)
        stack.append(start + duration)
    return depth
