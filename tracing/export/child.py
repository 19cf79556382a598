"""The export process's main loop (started by `tracing.export.process.ProcessExporter`).

Reads frames from stdin: first ("setup", spec, resource attributes, schema url), then
("spans", seq, batch) until the input ends. Each batch becomes the OTLP request
(`tracing.export.wire.RequestBuilder`) that the SDK exporter of the spec sends; the answer
(seq, ok) goes back on the file descriptor given as the first argument. At the end of
input it closes the exporter and exits.
"""

from __future__ import annotations

import logging
import marshal
import os
import signal
import sys

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from tracing.export.exporters import OtlpJsonFileExporter, make_exporter
from tracing.export.wire import ACK, FRAME, RequestBuilder, install_encoded_batches


def _read_exact(stream: object, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = stream.read(size)  # type: ignore[attr-defined]
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _frames(stream: object):  # noqa: ANN202 - a generator of decoded frames
    while True:
        head = _read_exact(stream, FRAME.size)
        if head is None:
            return
        body = _read_exact(stream, FRAME.unpack(head)[0])
        if body is None:
            return
        yield marshal.loads(body)


def main(argv: list[str]) -> None:
    # The program's Ctrl-C reaches its process group; this process ends with its input.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ack_fd, niceness = int(argv[0]), int(argv[1])
    try:
        os.nice(niceness)
    except OSError:
        pass
    logging.basicConfig(format="%(message)s")
    frames = _frames(sys.stdin.buffer)
    setup = next(frames, None)
    if setup is None or setup[0] != "setup":
        return
    _, spec, attributes, schema_url = setup
    exporter = make_exporter(tuple(spec))
    builder = RequestBuilder(Resource(attributes, schema_url))
    # The request is encoded here from the records; the exporter only sends it.
    encoded = isinstance(exporter, OtlpJsonFileExporter) or install_encoded_batches(
        sys.modules[type(exporter).__module__]
    )
    build = builder.request if encoded else builder.build
    os.write(ack_fd, ACK.pack(0, 1))
    log = logging.getLogger("tracing")
    try:
        for frame in frames:
            if frame[0] != "spans":
                continue
            _, seq, payload = frame
            try:
                ok = exporter.export(build(payload)) == SpanExportResult.SUCCESS
            except Exception:
                log.exception("tracing: export process: exporter %s raised", spec[0])
                ok = False
            os.write(ack_fd, ACK.pack(seq, 1 if ok else 0))
    except BrokenPipeError:
        pass  # the program is gone: nobody to answer
    finally:
        exporter.shutdown()
