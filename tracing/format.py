"""Text forms of a `StatsSnapshot`: one line per name, a table, a table across ranks."""

from __future__ import annotations

from collections.abc import Sequence

from tracing.snapshot import PhaseStats, StatsSnapshot

DEVICE_SUFFIX = "@device"
"""Names ending in this hold device time measured by the `events`/`sync` timing modes."""

_COLUMNS = ("count", "total", "mean", "min", "p50", "p95", "max", "share")


def format_duration(seconds: float) -> str:
    """Compact human duration: 812ns, 35.2us, 4.10ms, 2.31s, 3m05s."""
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f}ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f}ms"
    if seconds < 600.0:
        return f"{seconds:.2f}s"
    minutes, rest = divmod(seconds, 60.0)
    return f"{minutes:.0f}m{rest:02.0f}s"


def format_compact(snapshot: StatsSnapshot) -> str:
    """One line per name, in the spirit of the classic ProfileStats printout."""
    lines = []
    for name in sorted(snapshot.phases):
        s = snapshot.phases[name]
        lines.append(
            f"{name}: n={s.count} total={format_duration(s.total_s)} "
            f"mean={format_duration(s.mean_s)} min={format_duration(s.min_s if s.count else 0.0)} "
            f"max={format_duration(s.max_s)}"
        )
    return "\n".join(lines)


def _share_text(snapshot: StatsSnapshot, name: str) -> str:
    share = snapshot.share(name)
    return "-" if share is None else f"{share * 100:.1f}%"


def _row(name: str, s: PhaseStats, share: str) -> list[str]:
    return [
        name,
        str(s.count),
        format_duration(s.total_s),
        format_duration(s.mean_s),
        format_duration(s.min_s if s.count else 0.0),
        format_duration(s.p50_s),
        format_duration(s.p95_s),
        format_duration(s.max_s),
        share,
    ]


def _render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return out


def sorted_names(snapshot: StatsSnapshot) -> list[str]:
    """Names in a stable order with each device entry right under its host entry."""
    return sorted(snapshot.phases, key=lambda n: (n.removesuffix(DEVICE_SUFFIX), n))


def format_table(
    snapshot: StatsSnapshot,
    *,
    title: str | None = None,
    rank_snapshots: Sequence[StatsSnapshot] | None = None,
) -> str:
    """Table: phase, count, total, mean, min, p50, p95, max, share of its thread's wall time.

    With `rank_snapshots` (one per rank, e.g. gathered under torchrun) two columns give
    the lowest and highest per-rank total of each phase, with the rank that had it.
    """
    header = ["phase", *_COLUMNS]
    rows = []
    for name in sorted_names(snapshot):
        row = _row(name, snapshot.phases[name], _share_text(snapshot, name))
        if rank_snapshots:
            row += _rank_spread(name, rank_snapshots)
        rows.append(row)
    if rank_snapshots:
        header += ["rank min total", "rank max total"]
    lines = [title] if title else []
    if not rows:
        lines.append("(no phases recorded)")
        return "\n".join(lines)
    lines += _render(header, rows)
    return "\n".join(lines)


def _rank_spread(name: str, snaps: Sequence[StatsSnapshot]) -> list[str]:
    totals = []
    for index, snap in enumerate(snaps):
        stats = snap.phases.get(name)
        rank = snap.rank if snap.rank is not None else index
        totals.append((stats.total_s if stats else 0.0, rank))
    low, high = min(totals), max(totals)
    return [f"{format_duration(low[0])} (r{low[1]})", f"{format_duration(high[0])} (r{high[1]})"]
