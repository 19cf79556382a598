"""A live OTLP/gRPC receiver for the benchmarks: accepts spans and metrics, counts the
spans (when asked), discards both.

`OtlpSink()` starts it in a subprocess on a free 127.0.0.1 port (a separate process, so
its work does not compete with the measured program for the GIL); `.endpoint`,
`.spans()` (received so far) and `.close()`.
"""

from __future__ import annotations

import socket
import subprocess
import sys

_SERVER = r"""
import os, sys
# On a 2-core box the receiver shares the cores with the program it measures; at the
# lowest priority, and doing no more than receive, it takes what is idle, as a collector
# on its own cores would. Requests stay raw bytes (no protobuf parsing per request);
# they are parsed to count the spans only when a count is asked for.
os.nice(19)
from concurrent import futures
import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

received = []
empty = b""  # an empty Export*ServiceResponse

def export(request, context):
    received.append(request)
    return empty

def count():
    spans = 0
    for body in received:
        request = pb.ExportTraceServiceRequest.FromString(body)
        spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    return spans

raw = grpc.unary_unary_rpc_method_handler(export)  # no (de)serializers: bytes in and out
traces = grpc.method_handlers_generic_handler(
    "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": raw})
discard = grpc.unary_unary_rpc_method_handler(lambda request, context: empty)
metrics = grpc.method_handlers_generic_handler(
    "opentelemetry.proto.collector.metrics.v1.MetricsService", {"Export": discard})
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[traces, metrics])
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
print("ready", flush=True)
for line in sys.stdin:  # each line asks for the count; end of input ends the server
    print(count(), flush=True)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OtlpSink:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None and self._proc.stdin is not None
        if self._proc.stdout.readline().strip() != "ready":
            self.close()
            raise SystemExit("the OTLP sink did not start")

    def spans(self) -> int:
        self._proc.stdin.write("count\n")  # type: ignore[union-attr]
        self._proc.stdin.flush()  # type: ignore[union-attr]
        return int(self._proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait(5)
