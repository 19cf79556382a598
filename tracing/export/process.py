"""Span export from a child process, so OTLP encoding never holds the traced program's GIL.

Building SDK spans, encoding OTLP and driving gRPC cost 20-30 us of Python per span; on
an export thread all of it holds the GIL, which every training thread coming back from
a kernel then waits for. Here the export thread only marshals plain records
(`tracing.export.wire`, under 2 us per span, in C) to a child process, which encodes the OTLP
request from them and sends it with the SDK's own exporter
(`tracing.export.exporters.make_exporter`). One batch goes at a time and the child answers
each with success or failure, so the processor's delivery counts stay exact.

The child: `python -c` importing this package's `export_child`, at lower priority, in
its own session (a Ctrl-C meant for the program does not kill it before the last
batch). It exits when its input ends: at shutdown, or when the program dies, however it
dies. When it cannot start or dies, this exporter logs one line and exports in this
process from then on: telemetry costs more, but nothing is lost.
"""

from __future__ import annotations

import logging
import marshal
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tracing.config import TracingConfig
from tracing.export import wire
from tracing.export.exporters import ExporterSpec, exporter_specs, make_exporter
from tracing.export.wire import ACK, FRAME
from tracing.handle import readable_spans
from tracing.record import SCOPE_NAME, SCOPE_VERSION

if TYPE_CHECKING:
    from tracing.handle import SpanHandle

logger = logging.getLogger("tracing")

CHILD_NICENESS = 10
STARTUP_TIMEOUT_S = 60.0
"""How long the first export waits for the child to import the SDK and build its exporter."""
CLOSE_WAIT_S = 1.0
"""At shutdown: time for an idle child to close its exporter before it is killed."""

_live: weakref.WeakSet[ProcessExporter] = weakref.WeakSet()


class ProcessExporter(SpanExporter):
    """A SpanExporter whose `export` hands the batch to a child running `make_exporter(spec)`.

    Takes SpanHandles as they are (`takes_records`: the processor does not build SDK
    spans for it) as well as ReadableSpans. Thread contract: `export` runs on one thread
    at a time (the processor's worker); `shutdown` may run on another, meanwhile.
    """

    takes_records = True

    def __init__(self, spec: ExporterSpec, resource: Resource, *, start: bool = True) -> None:
        self.spec = spec
        self.resource = resource
        self._timeout_s = float(spec[4]) + 5.0 if spec[0] == "otlp" else 10.0
        self._own_scope: wire.Scope = (SCOPE_NAME, SCOPE_VERSION, None)
        self._proc: subprocess.Popen[bytes] | None = None
        self._in_fd = -1  # our end of the child's stdin
        self._ack_fd = -1  # our end of the child's answers
        self._acks = b""
        self._seq = 0
        self._ready = False
        self._local: SpanExporter | None = None  # after a failed child: export here
        self._closed = False
        self._write_lock = threading.Lock()
        self._ack_lock = threading.Lock()  # held while the worker waits for an answer
        self._pid = os.getpid()
        _live.add(self)
        if start:
            self._start()

    # --- child lifecycle ----------------------------------------------------------------

    def _start(self) -> None:
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(wire.__file__)))
        ack_read, ack_write = os.pipe()
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); "
            "from tracing.export.child import main; main(sys.argv[2:])"
        )
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code, package_root, str(ack_write), str(CHILD_NICENESS)],
                stdin=subprocess.PIPE,
                pass_fds=(ack_write,),
                start_new_session=True,
            )
        except OSError as exc:
            os.close(ack_read)
            os.close(ack_write)
            self._fall_back(f"could not start ({exc})")
            return
        os.close(ack_write)
        assert self._proc.stdin is not None
        self._in_fd = self._proc.stdin.fileno()
        self._ack_fd = ack_read
        header = (
            "setup",
            tuple(self.spec),
            dict(self.resource.attributes),
            self.resource.schema_url,
        )
        if not self._send(marshal.dumps(header)):
            self._fall_back("exited at start-up")

    def _fall_back(self, why: str) -> None:
        logger.warning(
            "tracing: the export process %s; exporting spans in this process from now on", why
        )
        self._stop_child(kill=True)
        if self._local is None and not self._closed:
            try:
                self._local = make_exporter(self.spec)
            except Exception:  # telemetry never crashes the host program
                logger.exception("tracing: could not build the exporter %s", self.spec[0])

    def _stop_child(self, *, kill: bool) -> None:
        proc = self._proc
        if proc is None:
            return
        if kill:
            proc.kill()
        try:
            proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(CLOSE_WAIT_S)

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's export process is the parent's. Drop our
        copies of its pipes (the child must see its input end when the parent ends)."""
        for fd in (self._in_fd, self._ack_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin = None  # its fd is closed above; the object must not close it again
        self._proc = None
        self._in_fd = self._ack_fd = -1
        self._closed = True

    # --- export -----------------------------------------------------------------------------

    def export(self, spans: Sequence[ReadableSpan | SpanHandle]) -> SpanExportResult:  # type: ignore[override]
        if self._closed:
            return SpanExportResult.FAILURE
        if self._proc is None and self._local is None:
            self._start()  # first export in a forked child
        if self._local is not None:
            return self._export_here(spans)
        payload = wire.encode_batch(spans, self._own_scope)
        self._seq += 1
        seq = self._seq
        sent = self._send(marshal.dumps(("spans", seq, payload)))
        answer = self._await_ack(seq) if sent else None
        if answer is None:  # the child is gone (or we were closed meanwhile)
            if self._closed:
                return SpanExportResult.FAILURE
            self._fall_back(f"exited (status {self._exit_status()})")
            return self._export_here(spans)
        return SpanExportResult.SUCCESS if answer else SpanExportResult.FAILURE

    def _export_here(self, spans: Sequence[ReadableSpan | SpanHandle]) -> SpanExportResult:
        if self._local is None:
            return SpanExportResult.FAILURE
        return self._local.export(readable_spans(spans))

    def _exit_status(self) -> str:
        proc = self._proc
        code = proc.poll() if proc is not None else None
        return "unknown" if code is None else str(code)

    def _send(self, frame: bytes) -> bool:
        """Writes one frame; False when the child is gone or we are closed."""
        data = FRAME.pack(len(frame)) + frame
        with self._write_lock:
            if self._closed or self._in_fd < 0:
                return False
            try:
                view = memoryview(data)
                while view:
                    written = os.write(self._in_fd, view)
                    view = view[written:]
            except OSError:  # BrokenPipeError: the child died
                return False
        return True

    def _await_ack(self, seq: int) -> bool | None:
        """The child's answer for batch `seq` (stale answers skipped); False after the
        timeout (the child may still answer later); None when the child is gone."""
        with self._ack_lock:
            return self._read_acks(seq)

    def _read_acks(self, seq: int) -> bool | None:
        if self._ack_fd < 0:
            return None
        timeout_s = self._timeout_s if self._ready else STARTUP_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        while True:
            while len(self._acks) >= ACK.size:
                got, ok = ACK.unpack_from(self._acks)
                self._acks = self._acks[ACK.size :]
                if got == 0:
                    self._ready = True
                    deadline = time.monotonic() + self._timeout_s
                elif got == seq:
                    return bool(ok)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning("tracing: the export process did not answer in %.0fs", timeout_s)
                return False
            try:
                readable, _, _ = select.select([self._ack_fd], [], [], remaining)
                if not readable:
                    continue
                data = os.read(self._ack_fd, 4096)
            except (OSError, ValueError):  # closed under us by shutdown
                return None
            if not data:
                return None
            self._acks += data

    # --- end ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ends the child's input, gives it CLOSE_WAIT_S to close its exporter, then kills
        it (a child still retrying a dead collector is cut off: the processor already
        counted that batch as failed or will)."""
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            if self._proc is not None and self._proc.stdin is not None:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass
            self._in_fd = -1
        self._stop_child(kill=False)
        # The worker may still be reading an answer; the child's end made that read
        # return, so the lock comes free at once (else the fd stays open: harmless).
        if self._ack_lock.acquire(timeout=CLOSE_WAIT_S):
            try:
                if self._ack_fd >= 0:
                    os.close(self._ack_fd)
                    self._ack_fd = -1
            finally:
                self._ack_lock.release()
        if self._local is not None:
            self._local.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export waits for the child's answer: nothing is held here


def _after_fork_in_child() -> None:
    pid = os.getpid()
    for exporter in list(_live):
        if exporter._pid != pid:  # not one made by another fork hook in this child
            exporter._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def build_exporters(
    cfg: TracingConfig, *, pid_suffix: bool = False, resource: Resource | None = None
) -> list[SpanExporter]:
    """The exporters named in `cfg.exporter`. With `resource` and `cfg.export_process`,
    OTLP and file exporters run in an export process (`ProcessExporter`), which starts
    now, or at its first export in a forked child (`pid_suffix`)."""
    exporters: list[SpanExporter] = []
    for spec in exporter_specs(cfg, pid_suffix=pid_suffix):
        if resource is not None and cfg.export_process and spec[0] != "console":
            exporters.append(ProcessExporter(spec, resource, start=not pid_suffix))
        else:
            exporters.append(make_exporter(spec))
    return exporters
