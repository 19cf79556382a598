"""Real OTLP receivers for tests: OTLP/HTTP (protobuf bodies) and OTLP/gRPC, in-process.

Each records, per request, the headers (or gRPC metadata) and the span names (or, for
a metrics request, the metric names; for a logs request over HTTP, the records) it got.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as metrics_rpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as rpc


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    span_names: list[str]
    resource: dict[str, str] = field(default_factory=dict)
    metric_names: list[str] = field(default_factory=list)
    log_records: list[dict[str, object]] = field(default_factory=list)


def _decode(body: bytes) -> tuple[list[str], dict[str, str]]:
    request = pb.ExportTraceServiceRequest.FromString(body)
    names, resource = [], {}
    for resource_spans in request.resource_spans:
        for attribute in resource_spans.resource.attributes:
            resource[attribute.key] = str(attribute.value).strip()
        for scope_spans in resource_spans.scope_spans:
            names += [span.name for span in scope_spans.spans]
    return names, resource


def _decode_metrics(body: bytes) -> tuple[list[str], dict[str, str]]:
    request = metrics_pb.ExportMetricsServiceRequest.FromString(body)
    names, resource = [], {}
    for resource_metrics in request.resource_metrics:
        for attribute in resource_metrics.resource.attributes:
            resource[attribute.key] = str(attribute.value).strip()
        for scope_metrics in resource_metrics.scope_metrics:
            names += [metric.name for metric in scope_metrics.metrics]
    return names, resource


def _decode_logs(body: bytes) -> tuple[list[dict[str, object]], dict[str, str]]:
    """Each record's event name, severity, body, attribute keys and ids (hex)."""
    request = logs_pb.ExportLogsServiceRequest.FromString(body)
    records, resource = [], {}
    for resource_logs in request.resource_logs:
        for attribute in resource_logs.resource.attributes:
            resource[attribute.key] = str(attribute.value).strip()
        for scope_logs in resource_logs.scope_logs:
            for record in scope_logs.log_records:
                records.append(
                    {
                        "event_name": record.event_name,
                        "severity": record.severity_text,
                        "body": record.body.string_value,
                        "attributes": sorted(a.key for a in record.attributes),
                        "trace_id": record.trace_id.hex(),
                        "span_id": record.span_id.hex(),
                    }
                )
    return records, resource


class HttpReceiver:
    """OTLP/HTTP on a free 127.0.0.1 port; `.endpoint` is its base URL."""

    def __init__(self) -> None:
        self.requests: list[Received] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                if "metrics" in self.path:  # the tests' metrics URLs all say so
                    names, resource = _decode_metrics(body)
                    received = Received(self.path, headers, [], resource, names)
                elif self.path.endswith("/v1/logs"):
                    records, resource = _decode_logs(body)
                    received = Received(self.path, headers, [], resource, [], records)
                else:
                    received = Received(self.path, headers, *_decode(body))
                receiver.requests.append(received)
                payload = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcReceiver:
    """OTLP/gRPC on a free 127.0.0.1 port; `.endpoint` is http://127.0.0.1:PORT."""

    def __init__(self) -> None:
        self.requests: list[Received] = []
        receiver = self

        class Service(rpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the gRPC method name
                metadata = {k: v for k, v in context.invocation_metadata()}
                names, resource = _decode(request.SerializeToString())
                receiver.requests.append(Received("Export", metadata, names, resource))
                return pb.ExportTraceServiceResponse()

        class MetricsService(metrics_rpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the gRPC method name
                metadata = {k: v for k, v in context.invocation_metadata()}
                names, resource = _decode_metrics(request.SerializeToString())
                receiver.requests.append(Received("Export", metadata, [], resource, names))
                return metrics_pb.ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        rpc.add_TraceServiceServicer_to_server(Service(), self._server)
        metrics_rpc.add_MetricsServiceServicer_to_server(MetricsService(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self._server.stop(grace=None)
