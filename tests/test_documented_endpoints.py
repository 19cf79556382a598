"""Every OTLP endpoint the README, the compose file and the docs show is sent in the
protocol its port speaks: OTLP/HTTP (the default, the specification's) to 4318, gRPC
(`--otlp-protocol grpc`) to 4317. The README's command once sent OTLP/HTTP to 4317:
0 spans arrived. tests/integration/test_doc_commands.py runs the commands themselves."""

from __future__ import annotations

from dflash.config.settings import TelemetryConfig
from tests.doc_commands import compose_trainer_command, otlp_mentions, runnable_commands
from tracing.config import parse_protocol
from tracing.export import otlp_protocol


def test_the_default_protocol_is_otlp_http() -> None:
    assert TelemetryConfig().otlp_protocol is None
    assert otlp_protocol(None, "traces") == "http/protobuf"


def test_every_documented_port_agrees_with_its_protocol(monkeypatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    mentions = otlp_mentions()
    assert len(mentions) >= 6, mentions
    wrong = []
    for mention in mentions:
        flag = None if mention.protocol is None else parse_protocol(mention.protocol)
        protocol = otlp_protocol(flag, "traces")  # what the trainer sends with that flag
        expected = {4317: "grpc", 4318: "http/protobuf"}.get(mention.port or 0)
        if protocol != expected:
            wrong.append(f"{mention.path}:{mention.line} {mention.url} sent as {protocol}")
    assert wrong == []


def test_the_readme_compose_and_docs_show_runnable_tracing_commands() -> None:
    commands = runnable_commands()
    shown_in = {path for paths in commands.values() for path in paths}
    assert {"README.md", "docker-compose.yml", "docs/observability.md"} <= shown_in, commands
    assert "dflash-train train --otlp-endpoint http://localhost:4318" in commands
    assert (
        "dflash-train train --otlp-endpoint http://localhost:4317 --otlp-protocol grpc" in commands
    )
    trainer = compose_trainer_command()
    assert trainer[:2] == ["dflash-train", "train"] and "--otlp-endpoint" in trainer
