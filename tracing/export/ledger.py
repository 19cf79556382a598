"""What forked children did with their spans, readable by the parent after they died.

A child that leaves normally flushes its spans (its finalizer) and reports its own
losses. One that is killed (`Pool.__exit__` terminates its workers with SIGTERM; a
flush from a signal handler can deadlock on the locks the killed thread held) loses
its queued spans with no one to say so. The parent keeps a shared anonymous mapping
with a slot per child: the child writes how many spans it queued and how many it
exported; the parent's shutdown report counts, for each child that is gone without
closing its slot, the difference as lost.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading

SLOTS = 4096
"""Children tracked per process (a pool restarted again and again may fork more; later
ones export as usual but are not covered)."""
_PID, _QUEUED, _EXPORTED = range(3)
_CLOSED = -1  # pid field of a child that shut down normally (its own report counted)


class ForkLedger:
    """The parent's ledger of its forked children (created at setup, one per process)."""

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, SLOTS * 3 * 8)  # MAP_SHARED | MAP_ANONYMOUS: seen after fork
        self._cells = memoryview(self._map).cast("q")
        self._next = 0
        self._fork_lock = threading.Lock()
        self.slot: ChildSlot | None = None  # this process's slot in its parent's ledger

    def before_fork(self) -> None:
        """In the parent, just before fork: the child takes the slot `_next` points at."""
        self._fork_lock.acquire()
        self._next += 1

    def after_fork_in_parent(self) -> None:
        self._fork_lock.release()

    def slot_for_this_child(self) -> ChildSlot | None:
        """In the child, just after fork: its slot (None when the ledger is full)."""
        self._fork_lock = threading.Lock()
        index = self._next - 1
        return ChildSlot(self._cells, index) if index < SLOTS else None

    def lost(self) -> tuple[int, int]:
        """(children gone with spans they queued and never exported, those spans)."""
        children = spans = 0
        for index in range(min(self._next, SLOTS)):
            base = index * 3
            pid = self._cells[base + _PID]
            if pid <= 0 or _alive(pid):
                continue
            lost = self._cells[base + _QUEUED] - self._cells[base + _EXPORTED]
            if lost > 0:
                children += 1
                spans += lost
        return children, spans


class ChildSlot:
    """A child's cells in its parent's ledger. `queued` runs on the threads that end
    spans, `exported` on an export thread; each keeps a counter of its own and writes
    the whole value (one 8-byte store), so the parent never reads a torn count."""

    __slots__ = ("_cells", "_base", "_queued", "_exported")

    def __init__(self, cells: memoryview, index: int) -> None:
        self._cells = cells
        self._base = index * 3
        self._queued = itertools.count(1)
        self._exported = 0
        cells[self._base + _QUEUED] = cells[self._base + _EXPORTED] = 0
        cells[self._base + _PID] = os.getpid()

    def queued(self) -> None:
        self._cells[self._base + _QUEUED] = next(self._queued)

    def exported(self, n: int) -> None:
        self._exported += n
        self._cells[self._base + _EXPORTED] = self._exported

    def close(self) -> None:
        """The child shut down and reported its own spans."""
        self._cells[self._base + _PID] = _CLOSED


def _alive(pid: int) -> bool:
    """Whether `pid` runs: not gone, and not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc here: a zombie counts as alive until reaped
