"""Text forms of a `StatsSnapshot`: one line per name, a table, a table across ranks."""

from __future__ import annotations

from collections.abc import Sequence

from tracing.snapshot import StatsSnapshot

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
    for name, s in sorted(snapshot.phases.items()):
        least = s.min_s if s.count else 0.0
        total, mean, low, high = map(format_duration, (s.total_s, s.mean_s, least, s.max_s))
        lines.append(f"{name}: n={s.count} total={total} mean={mean} min={low} max={high}")
    return "\n".join(lines)


def _row(snapshot: StatsSnapshot, name: str) -> list[str]:
    s, share = snapshot.phases[name], snapshot.share(name)
    durations = (s.total_s, s.mean_s, s.min_s if s.count else 0.0, s.p50_s, s.p95_s, s.max_s)
    share_text = "-" if share is None else f"{share * 100:.1f}%"
    return [name, str(s.count), *map(format_duration, durations), share_text]


def _render(table: Sequence[Sequence[str]]) -> list[str]:
    """The first column left-aligned, the others right-aligned."""
    widths = [max(map(len, column)) for column in zip(*table, strict=True)]
    return [
        "  ".join([row[0].ljust(widths[0]), *map(str.rjust, row[1:], widths[1:])]).rstrip()
        for row in table
    ]


def format_table(
    snapshot: StatsSnapshot,
    *,
    title: str | None = None,
    rank_snapshots: Sequence[StatsSnapshot] | None = None,
) -> str:
    """Table: phase, count, total, mean, min, p50, p95, max, share of its thread's wall
    time; with `rank_snapshots` (one per rank, e.g. gathered under torchrun), the lowest
    and highest per-rank total of each phase, with the rank that had it."""
    spread = ["rank min total", "rank max total"] if rank_snapshots else []
    names = sorted(snapshot.phases, key=lambda n: (n.removesuffix(DEVICE_SUFFIX), n))
    rows = [  # each device entry right under its host entry
        _row(snapshot, name) + (_rank_spread(name, rank_snapshots) if rank_snapshots else [])
        for name in names
    ]
    lines = [title] if title else []
    lines += _render([["phase", *_COLUMNS, *spread], *rows]) if rows else ["(no phases recorded)"]
    return "\n".join(lines)


def _rank_spread(name: str, snaps: Sequence[StatsSnapshot]) -> list[str]:
    totals = []  # (total, rank) per snapshot, the lowest and the highest shown
    for index, snap in enumerate(snaps):
        stats = snap.phases.get(name)
        totals.append((stats.total_s if stats else 0.0, index if snap.rank is None else snap.rank))
    return [f"{format_duration(total)} (r{rank})" for total, rank in (min(totals), max(totals))]
