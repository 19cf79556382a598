"""Why an OTLP export fails, told in one line within seconds of its first failed attempt.

The SDK's OTLP exporters retry a failed request with backoff until their timeout (10 s
by default) and log each attempt in their own words: raw HTTP/2 bytes when OTLP/HTTP
reaches a gRPC port, a status code otherwise. The export wrappers run each export of an
exporter `otlp_exporter` built inside `ExportWatch.exporting`, so a record the SDK logs
on that thread meanwhile is that export failing: `LogFilter` hands it to the watch and
drops it. The watch's first failure starts `probe` on a daemon thread (one TCP connect
and one HTTP/1.1 request, each bounded by PROBE_TIMEOUT_S: never the training's time),
and its verdict goes to the watch's `report` as one line. A successful export re-arms it.
An endpoint found unreachable is told once per outage to one `report`, whichever signal
(traces, metrics, logs) fails there first: the others' failures are counted.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

from tracing.config import call_logged

PROBE_TIMEOUT_S = 1.0
PORTS = {"grpc": 4317, "http/protobuf": 4318}  # OTLP's conventional ports
_MAX_SDK_TEXT = 160
_HTTP2_FRAME_TYPES = (0x04, 0x07)  # SETTINGS, GOAWAY: what a gRPC server sends first

logger = logging.getLogger("tracing")
Report = Callable[[str], None]


def default_report(line: str) -> None:
    logger.warning("tracing: %s", line)


def protocol_hint(setting: str, protocol: str) -> str:
    """How to choose `protocol`: `pass --flag grpc` for a flag, `set VAR=grpc` otherwise."""
    return f"pass {setting} {protocol}" if setting.startswith("-") else f"set {setting}={protocol}"


def _address(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an endpoint URL; one without a scheme is plain http."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    scheme = parsed.scheme or "http"
    port = parsed.port or (443 if scheme == "https" else 80)
    return scheme, parsed.hostname or "localhost", port


@dataclass(frozen=True)
class Verdict:
    """What a probe found: the likely cause (None: the endpoint answers as the protocol
    expects, so the cause is elsewhere), and whether no export to it can succeed."""

    cause: str | None
    unreachable: bool = False


def probe(
    url: str,
    protocol: str,
    protocol_setting: str = "OTEL_EXPORTER_OTLP_PROTOCOL",
    timeout_s: float = PROBE_TIMEOUT_S,
) -> Verdict:
    """The likely cause of failed exports to `url` over `protocol`: at most one TCP
    connect and one HTTP/1.1 request, each bounded by `timeout_s`."""
    scheme, host, port = _address(url)
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror:
        return Verdict(f"the host {host!r} is not known", True)
    except ConnectionRefusedError:
        return Verdict(
            f"nothing listens at {where} (connection refused): is the collector running?", True
        )
    except TimeoutError:
        return Verdict(f"{where} accepts no connection within {timeout_s:g} s", True)
    except OSError as exc:
        return Verdict(f"cannot connect to {where} ({exc.strerror or exc})", True)
    if scheme == "https":  # TLS: what speaks behind it is not seen without a handshake
        sock.close()
        return Verdict(None)
    reply, silent = b"", False
    with sock:
        try:
            request = f"GET / HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n"
            sock.sendall(request.encode("ascii"))
            reply = sock.recv(64)
            # Read the rest (bounded): closing on unread bytes resets the server's write.
            more, read, deadline = reply, len(reply), time.monotonic() + timeout_s
            while more and read < 65536 and time.monotonic() < deadline:
                more = sock.recv(4096)
                read += len(more)
        except TimeoutError:
            silent = not reply
        except OSError:
            pass
    if silent:
        return Verdict(f"{where} accepts connections but answers nothing within {timeout_s:g} s")
    speaks_http1 = reply.startswith(b"HTTP/1.")
    speaks_http2 = len(reply) >= 9 and reply[3] in _HTTP2_FRAME_TYPES and not speaks_http1
    if protocol != "grpc" and speaks_http2:
        return Verdict(
            f"{where} speaks gRPC (HTTP/2), not OTLP/HTTP: "
            f"{protocol_hint(protocol_setting, 'grpc')}, or use port {PORTS['http/protobuf']}",
            True,
        )
    if protocol == "grpc" and speaks_http1:
        return Verdict(
            f"{where} speaks HTTP/1.1 (OTLP/HTTP), not gRPC: "
            f"{protocol_hint(protocol_setting, 'http/protobuf')}, or use port {PORTS['grpc']}",
            True,
        )
    return Verdict(None)


def printable(text: str, limit: int = _MAX_SDK_TEXT) -> str:
    """`text` on one line, control and non-ASCII bytes escaped, at most `limit` long."""
    escaped = text.encode("ascii", "backslashreplace").decode("ascii")
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in escaped)
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."


class ExportWatch:
    """The failures of one OTLP exporter. Thread contract: `exporting` and `succeeded`
    on the exporter's calling thread; `failed` from the log filter on that thread; the
    probe on a daemon thread of its own; `report` is called there, once per outage."""

    def __init__(
        self,
        signal: str,
        url: str,
        protocol: str,
        report: Report | None = None,
        protocol_setting: str = "OTEL_EXPORTER_OTLP_PROTOCOL",
    ) -> None:
        self.signal, self.url, self.protocol = signal, url, protocol
        self.report = report or default_report
        self.protocol_setting = protocol_setting
        self.failing = False  # an export failed and none has succeeded since
        self.verdict: Verdict | None = None  # the probe's, on this outage, once known
        self.closed = False  # shut down: later failures are the shutdown's, not told
        self._key = (*_address(url)[1:], protocol)
        self._probe: threading.Thread | None = None

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """Around one call into the exporter: what the SDK logs meanwhile is this export's."""
        thread = threading.get_ident()
        _in_flight[thread] = self
        try:
            yield
        finally:
            _in_flight.pop(thread, None)

    def succeeded(self) -> None:
        _unreachable.discard(self._key)
        with _told_lock:
            if _told.get((id(self.report), self._key)) is self:
                del _told[(id(self.report), self._key)]
        if self.failing:
            self.failing, self.verdict = False, None

    def failed(self, sdk_text: str = "") -> None:
        """An attempt failed (`sdk_text`: the SDK's words): the first of an outage starts
        the probe, which reports one line."""
        if self.closed or self.failing:
            return
        self.failing = True
        thread = threading.Thread(
            target=self._diagnose, args=(sdk_text,), name="tracing-probe", daemon=True
        )
        self._probe = thread
        thread.start()

    def wait_for_probe(self, timeout_s: float) -> None:
        """Tests and shutdown: waits at most `timeout_s` for a running probe."""
        thread = self._probe
        if thread is not None:
            thread.join(timeout_s)

    def _diagnose(self, sdk_text: str) -> None:
        verdict = call_logged(probe, self.url, self.protocol, self.protocol_setting)
        verdict = verdict if isinstance(verdict, Verdict) else Verdict(None)
        if verdict.unreachable:
            _unreachable.add(self._key)
            if self._told_elsewhere():
                self.verdict = verdict
                return
        self.verdict = verdict
        cause = verdict.cause
        if cause is None:
            said = printable(sdk_text) if sdk_text else "it reported a failure"
            cause = f"the endpoint answers as {self.protocol} expects; the SDK says: {said}"
        line = (
            f"{self.signal} export to {self.url} ({self.protocol}) fails: {cause}; "
            f"the {self.signal} that fail are counted at shutdown"
        )
        call_logged(self.report, line)

    def _told_elsewhere(self) -> bool:
        """Whether another signal's watch with this `report` has told this endpoint
        unreachable in this outage (and is still open); else this one tells it: one
        line per endpoint, not one per signal sent there."""
        key = (id(self.report), self._key)
        with _told_lock:
            teller = _told.get(key)
            if teller is not None and teller is not self and not teller.closed:
                return True
            if not self.closed:
                _told[key] = self
        return False

    @property
    def unreachable(self) -> bool:
        """A probe found the endpoint unreachable or speaking another protocol (this
        exporter's, or another's to the same endpoint), and no export succeeded since:
        a shutdown need not wait for this exporter's retries."""
        return self._key in _unreachable


_unreachable: set[tuple[str, int, str]] = set()  # (host, port, protocol) found unreachable
_in_flight: dict[int, ExportWatch] = {}  # thread ident -> the watch exporting on it
# (id(report), endpoint) -> the watch that told it unreachable, until an export succeeds
_told: dict[tuple[int, tuple[str, int, str]], ExportWatch] = {}
_told_lock = threading.Lock()
_watches: weakref.WeakKeyDictionary[object, ExportWatch] = weakref.WeakKeyDictionary()


def watch(exporter: object, export_watch: ExportWatch) -> None:
    """Attaches `export_watch` to `exporter` (the export wrappers look it up)."""
    _watches[exporter] = export_watch


def watch_of(exporter: object) -> ExportWatch | None:
    return _watches.get(exporter)


class LogFilter(logging.Filter):
    """On the loggers of the SDK's OTLP exporters: a warning or error logged inside a
    watched export goes to its watch, not to the log; any other record passes at most
    once per message template every `period_s` (a dead collector would otherwise log an
    error for every batch, all through training)."""

    def __init__(self, period_s: float = 60.0) -> None:
        super().__init__()
        self.period_s = period_s
        self._last_s: dict[tuple[str, object], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        export_watch = _in_flight.get(record.thread or 0)
        if export_watch is not None and record.levelno >= logging.WARNING:
            export_watch.failed(record.getMessage())
            return False
        key, now_s = (record.name, record.msg), record.created
        if now_s - self._last_s.get(key, -self.period_s) < self.period_s:
            return False
        self._last_s[key] = now_s
        return True
