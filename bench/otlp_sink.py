"""A live OTLP/gRPC receiver for the benchmarks: accepts spans and metrics, counts the
spans, discards both.

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
# lowest priority it takes what is idle, as a collector on its own cores would.
os.nice(19)
from concurrent import futures
import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as rpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mrpc

class Sink(rpc.TraceServiceServicer):
    spans = 0
    def Export(self, request, context):
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                Sink.spans += len(ss.spans)
        return pb.ExportTraceServiceResponse()

class MetricsSink(mrpc.MetricsServiceServicer):
    def Export(self, request, context):
        return mpb.ExportMetricsServiceResponse()

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
rpc.add_TraceServiceServicer_to_server(Sink(), server)
mrpc.add_MetricsServiceServicer_to_server(MetricsSink(), server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
print("ready", flush=True)
for line in sys.stdin:  # each line asks for the count; end of input ends the server
    print(Sink.spans, flush=True)
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
