"""Static checks of the local observability stack (docker-compose.yml and docker/).

Docker does not run in the test suite, so whatever would make `docker compose up`
come up broken is checked here from the files: collector pipelines that name
undefined components, ports that disagree between compose and the service configs,
datasources pointing nowhere, unpinned images, and dashboard queries on metric names
the spanmetrics connector does not emit. Each checker returns a list of problems; the
tests run it on the real files (expecting none) and on a broken copy (expecting the
problem to be named), so every check is known to be able to fail.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCKER = REPO_ROOT / "docker"
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
GO_MOD = REPO_ROOT / "tools" / "jaeger" / "go.mod"
PROMETHEUS_GO_MOD = REPO_ROOT / "tools" / "prometheus" / "go.mod"
OTELCOL_GO_MOD = REPO_ROOT / "tools" / "otelcol" / "go.mod"

PHASES = (
    "batch",
    "batch_queue.wait",
    "target.forward",
    "target.read",
    "hs_queue.wait",
    "drafter.step",
    "drafter.anchor_selection",
    "drafter.block_prediction",
    "drafter.loss",
    "drafter.backward",
    "drafter.optimizer",
)
# Phases the stats (and so dflash.phase.duration) have but no span: targets blocked on a
# full hs_queue.
STATS_ONLY_PHASES = ("hs_queue.put",)
ALL_INTERFACES = {"0.0.0.0", "", "::", "[::]"}
# Grafana datasource type -> image repository of the service it must point at.
DATASOURCE_IMAGES = {
    "prometheus": "prom/prometheus",
    "tempo": "grafana/tempo",
    "jaeger": "jaegertracing/jaeger",
    "loki": "grafana/loki",
}
Stack = dict[str, Any]


# --- loading -----------------------------------------------------------------------


def load_stack() -> Stack:
    """Every stack file, parsed; keys name the file's role."""
    dashboards_dir = DOCKER / "grafana" / "dashboards"
    return {
        "compose": yaml.safe_load(COMPOSE_FILE.read_text()),
        "collector": yaml.safe_load((DOCKER / "otel-collector" / "config.yaml").read_text()),
        "jaeger": yaml.safe_load((DOCKER / "jaeger" / "config.yaml").read_text()),
        "tempo": yaml.safe_load((DOCKER / "tempo" / "config.yaml").read_text()),
        "loki": yaml.safe_load((DOCKER / "loki" / "config.yaml").read_text()),
        "prometheus": yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text()),
        "datasources": yaml.safe_load(
            (DOCKER / "grafana" / "provisioning" / "datasources" / "datasources.yaml").read_text()
        ),
        "dashboard_providers": yaml.safe_load(
            (DOCKER / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml").read_text()
        ),
        "dashboards": {p.name: json.loads(p.read_text()) for p in dashboards_dir.glob("*.json")},
        "dockerfiles": {
            str(p.relative_to(REPO_ROOT)): p.read_text() for p in DOCKER.rglob("Dockerfile")
        },
        "go_mod": GO_MOD.read_text(),
    }


@pytest.fixture
def stack() -> Stack:
    return load_stack()


def services(stack: Stack) -> dict[str, dict[str, Any]]:
    return stack["compose"]["services"]


def service_with_image(stack: Stack, repository: str) -> str:
    for name, service in services(stack).items():
        if str(service.get("image", "")).split(":")[0] == repository:
            return name
    raise AssertionError(f"no compose service runs {repository}")


def resolve_env(value: Any, env: dict[str, str]) -> str:
    """Expands the collector's `${env:NAME:-default}` and `${env:NAME}` placeholders."""

    def expand(match: re.Match[str]) -> str:
        return env.get(match["name"], match["default"] or "")

    return re.sub(r"\$\{env:(?P<name>\w+)(?::-(?P<default>[^}]*))?\}", expand, str(value))


def host_port(endpoint: str) -> tuple[str, int]:
    if "//" in endpoint:
        parts = urlsplit(endpoint)
        return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


# --- listen addresses of each service, from its own config --------------------------


def otlp_receiver_listens(receivers: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """protocol ("grpc"/"http") -> listen endpoint of the first OTLP receiver."""
    for name, receiver in receivers.items():
        if name.split("/")[0] == "otlp":
            protocols = receiver["protocols"]
            return {
                p: resolve_env((cfg or {}).get("endpoint", ""), env) for p, cfg in protocols.items()
            }
    return {}


def listens(stack: Stack) -> dict[str, dict[int, str]]:
    """compose service -> {port: listen host} of the servers its config opens."""
    result: dict[str, dict[int, str]] = {}
    jaeger_service = service_with_image(stack, "jaegertracing/jaeger")
    jaeger_env = env_of(services(stack)[jaeger_service])
    jaeger_cfg = stack["jaeger"]
    endpoints = list(otlp_receiver_listens(jaeger_cfg["receivers"], jaeger_env).values())
    query = jaeger_cfg["extensions"]["jaeger_query"]
    endpoints += [query["http"]["endpoint"], query["grpc"]["endpoint"]]
    endpoints.append(jaeger_cfg["extensions"]["healthcheckv2"]["http"]["endpoint"])
    result[jaeger_service] = {}
    for endpoint in endpoints:
        host, port = host_port(resolve_env(endpoint, jaeger_env))
        result[jaeger_service][port] = host

    collector_service = service_with_image(stack, "otel/opentelemetry-collector-contrib")
    collector = stack["collector"]
    ports: dict[int, str] = {}
    for endpoint in otlp_receiver_listens(collector["receivers"], {}).values():
        host, port = host_port(endpoint)
        ports[port] = host
    for name, exporter in collector["exporters"].items():
        if name.split("/")[0] == "prometheus":
            host, port = host_port(exporter["endpoint"])
            ports[port] = host
    for reader in collector["service"].get("telemetry", {}).get("metrics", {}).get("readers", []):
        prom = reader.get("pull", {}).get("exporter", {}).get("prometheus")
        if prom:
            ports[int(prom["port"])] = str(prom.get("host", "localhost"))
    result[collector_service] = ports

    tempo_service = service_with_image(stack, "grafana/tempo")
    tempo = stack["tempo"]
    ports = {int(tempo["server"]["http_listen_port"]): "0.0.0.0"}
    for endpoint in otlp_receiver_listens(tempo["distributor"]["receivers"], {}).values():
        host, port = host_port(endpoint)
        ports[port] = host
    result[tempo_service] = ports

    loki_service = service_with_image(stack, "grafana/loki")
    server = stack["loki"]["server"]
    result[loki_service] = {
        int(server["http_listen_port"]): str(server.get("http_listen_address", "0.0.0.0"))
    }

    prom_service = service_with_image(stack, "prom/prometheus")
    address = ":9090"
    for arg in services(stack)[prom_service].get("command") or []:
        if arg.startswith("--web.listen-address="):
            address = arg.split("=", 1)[1]
    host, port = host_port(address)
    result[prom_service] = {port: host}

    grafana_service = service_with_image(stack, "grafana/grafana")
    port = int(env_of(services(stack)[grafana_service]).get("GF_SERVER_HTTP_PORT", 3000))
    result[grafana_service] = {port: "0.0.0.0"}
    return result


def reachable_problem(stack: Stack, what: str, endpoint: str) -> str | None:
    """Why `endpoint` (host:port or URL) does not reach a compose service, or None."""
    host, port = host_port(endpoint)
    servers = listens(stack)
    if host not in services(stack):
        return f"{what}: host {host!r} is not a compose service"
    if port not in servers.get(host, {}):
        return f"{what}: {host} does not listen on port {port} ({sorted(servers.get(host, {}))})"
    if servers[host][port] not in ALL_INTERFACES:
        where = f"{servers[host][port]}:{port}"
        return f"{what}: {host} listens on {where}, unreachable from other containers"
    return None


# --- checkers ----------------------------------------------------------------------


def pipeline_problems(config: dict[str, Any]) -> list[str]:
    """Components a collector (or Jaeger v2) pipeline names but does not define."""
    problems = []
    connectors = config.get("connectors") or {}
    service = config["service"]
    for extension in service.get("extensions") or []:
        if extension not in (config.get("extensions") or {}):
            problems.append(f"service.extensions: {extension} is not defined")
    as_exporter, as_receiver = set(), set()
    for pipeline_name, pipeline in service["pipelines"].items():
        if not pipeline.get("receivers") or not pipeline.get("exporters"):
            problems.append(f"pipeline {pipeline_name}: needs receivers and exporters")
        for kind in ("receivers", "processors", "exporters"):
            defined = config.get(kind) or {}
            for name in pipeline.get(kind) or []:
                if name in connectors and kind != "processors":
                    (as_receiver if kind == "receivers" else as_exporter).add(name)
                elif name not in defined:
                    problems.append(f"pipeline {pipeline_name}: {kind[:-1]} {name} is not defined")
    for name in sorted(as_exporter ^ as_receiver):
        problems.append(
            f"connector {name} must be an exporter of one pipeline and a receiver of another"
        )
    return problems


def image_problems(stack: Stack) -> list[str]:
    problems = []
    images = [
        (f"service {name}", s["image"]) for name, s in services(stack).items() if "build" not in s
    ]
    for path, text in stack["dockerfiles"].items():
        images += [(path, m) for m in re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)]
    for where, image in images:
        if "@sha256:" in image:
            continue
        _, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else ("", "", "")
        if not tag or tag == "latest" or not re.search(r"\d", tag):
            problems.append(f"{where}: image {image} is not pinned to a version")
    for name, service in services(stack).items():
        if "build" not in service and "image" not in service:
            problems.append(f"service {name}: neither image nor build")
    return problems


def jaeger_version_problems(stack: Stack) -> list[str]:
    """The compose image and the Go module the tests build are one Jaeger release.

    Jaeger ships v1.N.P and v2.(N-63).P together (v1.63.0 / v2.0.0 onwards).
    """
    image = services(stack)[service_with_image(stack, "jaegertracing/jaeger")]["image"]
    tag = image.rpartition(":")[2]
    module = re.search(r"github\.com/jaegertracing/jaeger v1\.(\d+)\.(\d+)", stack["go_mod"])
    if module is None:
        return ["tools/jaeger/go.mod does not require github.com/jaegertracing/jaeger v1.x"]
    expected = f"2.{int(module[1]) - 63}.{module[2]}"
    if tag != expected:
        return [
            f"Jaeger image {image}, but tools/jaeger builds v1.{module[1]}.{module[2]} = {expected}"
        ]
    return []


def prometheus_version_problems(stack: Stack, go_mod: str | None = None) -> list[str]:
    """The compose image is the release tools/prometheus builds: v3.X.Y is the Go module
    version v0.3XX.Y (minor zero-padded to two digits)."""
    text = PROMETHEUS_GO_MOD.read_text() if go_mod is None else go_mod
    found = re.search(r"github\.com/prometheus/prometheus v0\.3(\d\d)\.(\d+)\b", text)
    if not found:
        return ["tools/prometheus/go.mod requires no github.com/prometheus/prometheus v0.3XX.Y"]
    release = f"v3.{int(found[1])}.{found[2]}"
    image = services(stack)[service_with_image(stack, "prom/prometheus")]["image"]
    tag = image.rsplit(":", 1)[-1]
    if tag != release:
        return [f"compose runs {image}, tools/prometheus builds {release} ({found[0].split()[-1]})"]
    return []


def otelcol_version_problems(stack: Stack, go_mod: str | None = None) -> list[str]:
    """The compose file's otelcol-contrib image is the release tools/otelcol builds: its
    contrib components at the image's version, the core Collector at the same minor."""
    text = OTELCOL_GO_MOD.read_text() if go_mod is None else go_mod
    image = services(stack)[service_with_image(stack, "otel/opentelemetry-collector-contrib")][
        "image"
    ]
    tag = image.rsplit(":", 1)[-1]
    contrib = set(re.findall(r"opentelemetry-collector-contrib/\S+ v(\S+)", text))
    core = re.search(r"go\.opentelemetry\.io/collector/otelcol v0\.(\d+)\.", text)
    problems = []
    if contrib != {tag}:
        problems.append(f"compose runs {image}, tools/otelcol builds contrib {sorted(contrib)}")
    if core is None or core[1] != tag.split(".")[1]:
        problems.append(
            f"compose runs {image}, tools/otelcol's core otelcol is not 0.{tag.split('.')[1]}"
        )
    return problems


def published_port_problems(stack: Stack) -> list[str]:
    """Every published container port is one the service's config listens on."""
    problems = []
    servers = listens(stack)
    for name, service in services(stack).items():
        for mapping in service.get("ports") or []:
            container_port = int(str(mapping).split(":")[-1].split("/")[0])
            if name in servers and container_port not in servers[name]:
                problems.append(
                    f"service {name}: publishes {container_port}, listens {sorted(servers[name])}"
                )
            elif servers.get(name, {}).get(container_port, "0.0.0.0") not in ALL_INTERFACES:
                problems.append(f"service {name}: port {container_port} listens on localhost only")
    return problems


def wiring_problems(stack: Stack) -> list[str]:
    """Collector exporters, Prometheus targets, datasources and the trainer reach their peers."""
    problems: list[str | None] = []
    for name, exporter in stack["collector"]["exporters"].items():
        if name.split("/")[0] in ("otlp", "otlphttp"):
            problems.append(
                reachable_problem(stack, f"collector exporter {name}", exporter["endpoint"])
            )
            host, port = host_port(exporter["endpoint"])
            peer = {
                "jaeger": stack["jaeger"]["receivers"],
                "tempo": stack["tempo"]["distributor"]["receivers"],
            }
            env = env_of(services(stack).get(host, {}))
            listen = otlp_receiver_listens(peer.get(host, {}), env)
            protocol = "grpc" if name.split("/")[0] == "otlp" else "http"
            if host in peer and (protocol not in listen or host_port(listen[protocol])[1] != port):
                problems.append(
                    f"collector exporter {name}: port {port} is not {host}'s OTLP {protocol} port"
                )
    for job in stack["prometheus"]["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                problems.append(
                    reachable_problem(stack, f"prometheus job {job['job_name']}", target)
                )
    for source in stack["datasources"]["datasources"]:
        where = f"datasource {source['name']}"
        problems.append(reachable_problem(stack, where, source["url"]))
        host = urlsplit(source["url"]).hostname
        wanted = DATASOURCE_IMAGES.get(source["type"])
        image = str(services(stack).get(host, {}).get("image", ""))
        if wanted and image.split(":")[0] != wanted:
            problems.append(
                f"{where}: type {source['type']} points at {host} ({image or 'no image'})"
            )
    command = [str(arg) for arg in services(stack).get("trainer", {}).get("command") or []]
    if "--otlp-endpoint" in command:
        endpoint = command[command.index("--otlp-endpoint") + 1]
        problems.append(reachable_problem(stack, "trainer --otlp-endpoint", endpoint))
        protocol = (
            command[command.index("--otlp-protocol") + 1]
            if "--otlp-protocol" in command
            else "grpc"
        )
        listen = otlp_receiver_listens(stack["collector"]["receivers"], {})
        if host_port(listen.get(protocol, ":0"))[1] != host_port(endpoint)[1]:
            problems.append(
                f"trainer --otlp-endpoint {endpoint} is not the collector's OTLP {protocol} port"
            )
    return [p for p in problems if p]


def mount_problems(stack: Stack) -> list[str]:
    """Bind-mounted files exist, and each service's --config flag names a mounted file."""
    problems = []
    for name, service in services(stack).items():
        targets = set()
        for volume in service.get("volumes") or []:
            source, target = str(volume).split(":")[:2]
            targets.add(target)
            # Read-only mounts are the stack's configs; writable ones (./runs) are outputs
            # that docker creates.
            read_only = str(volume).endswith(":ro")
            if read_only and source.startswith(".") and not (REPO_ROOT / source).exists():
                problems.append(f"service {name}: mounts {source}, which does not exist")
        for arg in service.get("command") or []:
            match = re.match(r"-{1,2}config(?:\.file)?=(.+)", str(arg))
            if match and not any(match[1] == t or match[1].startswith(t + "/") for t in targets):
                problems.append(f"service {name}: {arg} is not a mounted file")
    grafana = services(stack)[service_with_image(stack, "grafana/grafana")]
    grafana_targets = {str(v).split(":")[1] for v in grafana.get("volumes") or []}
    for provider in stack["dashboard_providers"]["providers"]:
        if provider["options"]["path"] not in grafana_targets:
            problems.append(
                f"dashboard provider {provider['name']}: {provider['options']['path']} not mounted"
            )
    return problems


def duration_ms(text: str) -> float:
    units = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4, "h": 3.6e6}
    total = 0.0
    for number, unit in re.findall(r"([\d.]+)(ns|us|µs|ms|s|m|h)", text):
        total += float(number) * units[unit]
    return total


def spanmetrics_config(stack: Stack) -> dict[str, Any]:
    connectors = stack["collector"].get("connectors") or {}
    found = [cfg or {} for name, cfg in connectors.items() if name.split("/")[0] == "spanmetrics"]
    assert len(found) == 1, "the collector needs exactly one spanmetrics connector"
    return found[0]


def bucket_problems(stack: Stack) -> list[str]:
    """Histogram buckets cover phases from 0.1 ms to 30 s, in increasing order."""
    buckets = spanmetrics_config(stack).get("histogram", {}).get("explicit", {}).get("buckets")
    if not buckets:
        return ["spanmetrics: no explicit buckets (the defaults start at 2 ms)"]
    bounds = [duration_ms(str(b)) for b in buckets]
    problems = []
    if bounds != sorted(set(bounds)):
        problems.append(f"spanmetrics buckets not strictly increasing: {buckets}")
    if bounds[0] > 0.1:
        problems.append(f"spanmetrics: first bucket {buckets[0]} is above 0.1 ms")
    if bounds[-1] < 30_000:
        problems.append(f"spanmetrics: last bucket {buckets[-1]} is below 30 s")
    return problems


def prometheus_exporter(stack: Stack) -> dict[str, Any]:
    exporters = [
        e or {}
        for n, e in stack["collector"]["exporters"].items()
        if n.split("/")[0] == "prometheus"
    ]
    assert len(exporters) == 1, "the collector needs exactly one prometheus exporter"
    return exporters[0]


def prometheus_name(exporter: dict[str, Any], name: str, unit: str, kind: str) -> str:
    """The prometheus exporter's translation of one OTel metric: dots to underscores,
    then the unit word (annotations such as {token} dropped, "1" as _ratio on gauges),
    then `_total` for counters."""
    strategy = exporter.get("translation_strategy") or (
        "UnderscoreEscapingWithSuffixes"
        if exporter.get("add_metric_suffixes", True)
        else "UnderscoreEscapingWithoutSuffixes"
    )
    if strategy.startswith("UnderscoreEscaping"):
        name = re.sub(r"[^a-zA-Z0-9_:]", "_", name)
    if strategy.endswith("WithSuffixes"):
        words = {"ms": "milliseconds", "s": "seconds", "By": "bytes"}
        word = words.get(unit, "ratio" if unit == "1" and kind == "gauge" else "")
        name += f"_{word}" if word else ""
        name += "_total" if kind == "counter" else ""
    prefix = exporter.get("namespace")
    return f"{prefix}_{name}" if prefix else name


def emitted_metrics(stack: Stack) -> tuple[set[str], set[str]]:
    """(metric names, label names) Prometheus holds: what it scrapes from the collector
    and the trainer's metrics the collector pushes into its OTLP receiver."""
    scraped_names, scraped_labels = scraped_metrics(stack)
    app_names, app_labels = app_metrics(stack)
    return scraped_names | app_names, scraped_labels | app_labels


def scraped_metrics(stack: Stack) -> tuple[set[str], set[str]]:
    """(metric names, label names) the collector's prometheus exporter serves.

    Mirrors the spanmetrics connector (contrib v0.140): `<namespace>.calls` (monotonic
    sum) and `<namespace>.duration` (histogram in `histogram.unit`); the trainer's own
    metrics (dflash.observe.metrics.METRICS) when a metrics pipeline takes OTLP into the
    prometheus exporter; and that exporter's name translation.
    """
    connector = spanmetrics_config(stack)
    namespace = connector.get("namespace", "traces.span.metrics")
    unit = connector.get("histogram", {}).get("unit", "ms")
    exporter = prometheus_exporter(stack)

    def prom(name: str, unit_name: str, counter: bool) -> str:
        return prometheus_name(exporter, name, unit_name, "counter" if counter else "")

    prefix = f"{namespace}." if namespace else ""
    names = {prom(f"{prefix}calls", "", True)}
    if not connector.get("histogram", {}).get("disable"):
        duration = prom(f"{prefix}duration", unit, False)
        names |= {f"{duration}_bucket", f"{duration}_sum", f"{duration}_count"}
    dimensions = ["service.name", "span.name", "span.kind", "status.code"]
    dimensions += [d["name"] for d in connector.get("dimensions") or []]
    excluded = set(connector.get("exclude_dimensions") or [])
    labels = {re.sub(r"[^a-zA-Z0-9_]", "_", d) for d in dimensions if d not in excluded}
    app_names, app_labels = app_metrics(stack, "prometheus")
    return names | app_names, labels | app_labels | {"le", "job", "instance"}


# Resource attributes of the trainer's metrics that the dashboard may select on.
APP_RESOURCE_LABELS = {"service_name", "service_instance_id", "dflash_run_id", "dflash_rank"}
OTLP_PATH = "/api/v1/otlp"


def app_metrics_path(stack: Stack) -> str | None:
    """How the trainer's metrics reach Prometheus: "prometheus" (a collector pipeline from
    the OTLP receiver into the prometheus exporter, scraped), "otlp" (into an otlphttp
    exporter that posts to Prometheus' OTLP receiver), or None."""
    exporters = stack["collector"]["exporters"]
    prometheus_host = service_with_image(stack, "prom/prometheus")
    for pipeline in stack["collector"]["service"]["pipelines"].values():
        if "otlp" not in (pipeline.get("receivers") or []):
            continue
        for name in pipeline.get("exporters") or []:
            if name.split("/")[0] == "prometheus":
                return "prometheus"
            endpoint = str((exporters.get(name) or {}).get("endpoint", ""))
            if name.split("/")[0] == "otlphttp" and urlsplit(endpoint).hostname == prometheus_host:
                return "otlp" if urlsplit(endpoint).path.rstrip("/") == OTLP_PATH else None
    return None


def app_metrics(stack: Stack, path: str | None = None) -> tuple[set[str], set[str]]:
    """Prometheus names and labels of dflash.observe.metrics.METRICS as they reach
    Prometheus (`path`, else the stack's: app_metrics_path). Scraped from the prometheus
    exporter, a histogram is classic (_bucket, _sum, _count); pushed over OTLP with
    native histograms enabled and explicit ones converted (convert_histograms_to_nhcb),
    it is one native histogram series whatever the trainer's phase_histogram."""
    from dflash.observe.metrics import METRICS, NAMESPACE

    found = app_metrics_path(stack)
    if found is None or (path is not None and path != found):
        return set(), set()
    labels = {re.sub(r"[^a-zA-Z0-9_]", "_", label) for spec in METRICS for label in spec.labels}
    if found == "prometheus":
        exporter = prometheus_exporter(stack)
        resource = (exporter.get("resource_to_telemetry_conversion") or {}).get("enabled")
    else:
        otlp = stack["prometheus"].get("otlp") or {}
        exporter = {"translation_strategy": otlp.get("translation_strategy")}
        resource = otlp.get("promote_all_resource_attributes") or APP_RESOURCE_LABELS <= {
            re.sub(r"[^a-zA-Z0-9_]", "_", a) for a in otlp.get("promote_resource_attributes", [])
        }
        native = "native-histograms" in prometheus_feature_flags(stack)
        labels |= {"job", "instance"}  # service.name and service.instance.id, mapped
    names: set[str] = set()
    for spec in METRICS:
        base = prometheus_name(exporter, f"{NAMESPACE}.{spec.name}", spec.unit, spec.kind)
        if spec.kind != "histogram":
            names.add(base)
        elif found == "otlp" and native and otlp.get("convert_histograms_to_nhcb"):
            names.add(base)
        else:  # classic, or nothing at all for an exponential one without native ones
            names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return names, labels | (APP_RESOURCE_LABELS if resource else set())


def prometheus_queries(stack: Stack) -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target, template variable and datasource link."""
    queries = []
    for file_name, dashboard in stack["dashboards"].items():
        panels = list(dashboard.get("panels", []))
        for panel in panels:
            panels += panel.get("panels", [])  # collapsed rows nest their panels
            for target in panel.get("targets", []):
                if "expr" in target:
                    queries.append((f"{file_name} panel {panel.get('title')!r}", target["expr"]))
        for variable in dashboard.get("templating", {}).get("list", []):
            query = variable.get("query")
            query = query.get("query") if isinstance(query, dict) else query
            if query:
                queries.append((f"{file_name} variable {variable['name']}", query))
    for source in stack["datasources"]["datasources"]:
        for link in source.get("jsonData", {}).get("tracesToMetrics", {}).get("queries", []):
            queries.append((f"datasource {source['name']} link {link['name']!r}", link["query"]))
    return queries


IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_VALUES = rf"label_values\(\s*({IDENT})\s*,\s*(\w+)\s*\)"


def without_grafana_variables(query: str) -> str:
    # Grafana macros and variables ($__tags, $$__rate_interval, ${service}) are not PromQL.
    return re.sub(r"\$+\{?[\w.]+\}?", "", query)


def metric_names_in(query: str) -> set[str]:
    """Metric names a PromQL query (with Grafana variables) selects."""
    plain = without_grafana_variables(query)
    used = set(re.findall(rf"({IDENT})\s*\{{", plain))
    used |= set(re.findall(rf"({IDENT})\s*\[", plain))
    used |= {metric for metric, _ in re.findall(LABEL_VALUES, plain)}
    return used


def dashboard_problems(stack: Stack) -> list[str]:
    """Queries name only metrics and labels the spanmetrics connector emits, and real phases."""
    names, labels = emitted_metrics(stack)
    problems = []
    queries = prometheus_queries(stack)
    if not queries:
        problems.append("no Prometheus queries in the provisioned dashboards")
    for where, query in queries:
        plain = without_grafana_variables(query)
        used = metric_names_in(query)
        used_labels = {label for _, label in re.findall(LABEL_VALUES, plain)}
        if not used:
            problems.append(f"{where}: no metric selector in {query!r}")
        for metric in sorted(used - names):
            problems.append(f"{where}: metric {metric} is not emitted (emitted: {sorted(names)})")
        for body in re.findall(r"\{([^}]*)\}", plain):
            used_labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body))
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", plain):
            used_labels |= {label.strip() for label in group.split(",") if label.strip()}
        for label in sorted(used_labels - labels):
            problems.append(f"{where}: label {label} is not emitted (emitted: {sorted(labels)})")
        for phase in re.findall(r'span_name\s*=\s*"([^"]*)"', query):
            if phase not in PHASES:
                problems.append(f"{where}: span_name {phase!r} is not a dflash-train phase")
        for phase in re.findall(r'\bdflash_phase\s*=\s*"([^"]*)"', query):
            if phase not in PHASES + STATS_ONLY_PHASES:
                problems.append(f"{where}: phase {phase!r} is not a dflash-train phase")
    for file_name, dashboard in stack["dashboards"].items():
        uids = {s.get("uid") for s in stack["datasources"]["datasources"]}
        for panel in dashboard.get("panels", []):
            uid = (panel.get("datasource") or {}).get("uid")
            if uid and uid not in uids and not uid.startswith("$"):
                problems.append(
                    f"{file_name} panel {panel.get('title')!r}: datasource {uid} not provisioned"
                )
    return problems


def load_integration_conftest() -> ModuleType:
    path = REPO_ROOT / "tests" / "integration" / "conftest.py"
    spec = importlib.util.spec_from_file_location("integration_conftest_for_stack_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def jaeger_test_config_problems(stack: Stack) -> list[str]:
    """The Jaeger the tests start is docker/jaeger/config.yaml, with all its ports moved."""
    module = load_integration_conftest()
    problems = []
    mounted = [
        v.split(":")[0]
        for v in services(stack)[service_with_image(stack, "jaegertracing/jaeger")].get(
            "volumes", []
        )
    ]
    compose_file = (REPO_ROOT / mounted[0]).resolve() if mounted else None
    if Path(module.JAEGER_CONFIG).resolve() != compose_file:
        problems.append(f"tests start {module.JAEGER_CONFIG}, compose mounts {compose_file}")
    referenced = set(re.findall(r"\$\{env:(\w+)", yaml.safe_dump(stack["jaeger"])))
    set_by_tests = set(module.JaegerPorts(1, 2, 3, 4, 5, 6).environment())
    for name in sorted(referenced - set_by_tests):
        problems.append(f"docker/jaeger/config.yaml reads {name}, which the tests do not set")
    return problems


def expiration_problems(stack: Stack) -> list[str]:
    """Span metrics of services no longer sending (finished runs) expire."""
    expiration = spanmetrics_config(stack).get("metrics_expiration")
    if not expiration or duration_ms(str(expiration)) <= 0:
        return ["spanmetrics: no metrics_expiration (finished runs' series live forever)"]
    return []


def prometheus_feature_flags(stack: Stack) -> list[str]:
    """The --enable-feature values of the compose Prometheus (the integration tests run
    the real Prometheus with them)."""
    command = services(stack)["prometheus"].get("command", [])
    flags = [arg.split("=", 1)[1] for arg in command if arg.startswith("--enable-feature=")]
    return [feature for flag in flags for feature in flag.split(",")]


def exemplar_problems(stack: Stack) -> list[str]:
    """From a latency point to its trace: the connector keeps exemplars, the collector
    exposes them (OpenMetrics; the phase histogram's travel over OTLP), Prometheus
    stores them, Grafana links them to the trace datasources, and a trace links back
    to the metrics of its own run."""
    problems = []
    if not spanmetrics_config(stack).get("exemplars", {}).get("enabled"):
        problems.append("spanmetrics: exemplars not enabled")
    exporter = stack["collector"]["exporters"].get("prometheus", {})
    if exporter.get("enable_open_metrics") is not True:
        problems.append("collector prometheus exporter: enable_open_metrics is not true")
    if "exemplar-storage" not in prometheus_feature_flags(stack):
        problems.append("prometheus: --enable-feature=exemplar-storage missing")
    sources = {source["uid"]: source for source in stack["datasources"]["datasources"]}
    links = sources["prometheus"].get("jsonData", {}).get("exemplarTraceIdDestinations", [])
    for link in links:
        if link.get("name") != "trace_id" or link.get("datasourceUid") not in sources:
            problems.append(
                f"prometheus datasource: exemplar link {link} is not trace_id to a source"
            )
    if {link.get("datasourceUid") for link in links} < {"jaeger", "tempo"}:
        problems.append("prometheus datasource: exemplars do not link to Jaeger and Tempo")
    for uid in ("jaeger", "tempo"):
        tags = sources[uid].get("jsonData", {}).get("tracesToMetrics", {}).get("tags", [])
        if {"key": "dflash.run.id", "value": "dflash_run_id"} not in tags:
            problems.append(f"{uid} datasource: traces-to-metrics not keyed by dflash.run.id")
    return problems


HISTOGRAM_VARIABLE = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
QUANTILE = re.compile(r"histogram_quantile\(\s*[\d.]+\s*,\s*sum by \(([^)]*)\) \(rate\((\w+)\{")


def quantile_problems(stack: Stack) -> list[str]:
    """p50/p95 within one bucket (9 %), not octave bounds (up to 2x off): the trainer of
    the stack exports the phase histogram exponential (OTel's variable, tracing's
    `phase_histogram`), the collector pushes it into Prometheus' OTLP receiver (the
    prometheus exporter drops exponential histograms), Prometheus keeps it as a native
    histogram (explicit ones converted too, so the one series name reads both), and the
    dashboard's quantiles read that native histogram, not `_bucket` series."""
    problems = []
    trainer = services(stack).get("trainer", {})
    if env_of(trainer).get(HISTOGRAM_VARIABLE) != "base2_exponential_bucket_histogram":
        problems.append(f"trainer: {HISTOGRAM_VARIABLE} is not base2_exponential_bucket_histogram")
    if app_metrics_path(stack) != "otlp":
        problems.append(f"collector: the trainer's metrics do not reach Prometheus' {OTLP_PATH}")
    command = [str(arg) for arg in services(stack)["prometheus"].get("command") or []]
    if "--web.enable-otlp-receiver" not in command:
        problems.append("prometheus: --web.enable-otlp-receiver missing")
    if "native-histograms" not in prometheus_feature_flags(stack):
        problems.append("prometheus: --enable-feature=native-histograms missing")
    if not (stack["prometheus"].get("otlp") or {}).get("convert_histograms_to_nhcb"):
        problems.append("prometheus: otlp.convert_histograms_to_nhcb is not true")
    for where, query in prometheus_queries(stack):
        for by, metric in QUANTILE.findall(query):
            if metric.startswith("dflash_") and (metric.endswith("_bucket") or "le" in by):
                problems.append(f"{where}: quantile of {metric} by ({by}) is not native")
    return problems


def logs_problems(stack: Stack) -> list[str]:
    """From the trainer's log records to Loki and back: the collector has a logs pipeline
    from its OTLP receiver to an exporter that reaches the Loki service over OTLP/HTTP
    (`/otlp`), Loki keeps OTLP's structured metadata (the records' trace_id) and the run
    as a label, the trace datasources link a span to its trace's logs in Loki, and the
    Loki datasource links a record's trace_id back to Jaeger."""
    problems = []
    collector = stack["collector"]
    loki_service = service_with_image(stack, "grafana/loki")
    to_loki = [
        name
        for name, exporter in collector["exporters"].items()
        if name.split("/")[0] == "otlphttp"
        and host_port(exporter.get("endpoint", ""))[0] == loki_service
    ]
    if not to_loki:
        problems.append("collector: no otlphttp exporter sends to Loki")
    for name in to_loki:
        if urlsplit(collector["exporters"][name]["endpoint"]).path.rstrip("/") != "/otlp":
            problems.append(f"collector exporter {name}: Loki takes OTLP under /otlp")
    pipelines = collector["service"]["pipelines"]
    logs = [p for n, p in pipelines.items() if n.split("/")[0] == "logs"]
    if not any(
        "otlp" in pipeline.get("receivers", []) and set(to_loki) & set(pipeline.get("exporters"))
        for pipeline in logs
    ):
        problems.append("collector: no logs pipeline from the OTLP receiver to Loki")
    limits = stack["loki"].get("limits_config", {})
    if limits.get("allow_structured_metadata") is not True:
        problems.append("loki: allow_structured_metadata is not true (OTLP ingestion fails)")
    schemas = [c.get("schema") for c in stack["loki"].get("schema_config", {}).get("configs", [])]
    if not schemas or schemas[-1] != "v13":
        problems.append(f"loki: schema {schemas[-1:]} is not v13 (no structured metadata)")
    labels = [
        attribute
        for rule in limits.get("otlp_config", {})
        .get("resource_attributes", {})
        .get("attributes_config", [])
        if rule.get("action") == "index_label"
        for attribute in rule.get("attributes", [])
    ]
    if "dflash.run.id" not in labels:
        problems.append("loki: dflash.run.id is not a stream label (a run's logs need a scan)")
    sources = {source["uid"]: source for source in stack["datasources"]["datasources"]}
    loki_uids = [uid for uid, source in sources.items() if source["type"] == "loki"]
    if not loki_uids:
        problems.append("grafana: no Loki datasource")
    for uid in ("jaeger", "tempo"):
        link = sources[uid].get("jsonData", {}).get("tracesToLogsV2", {})
        query = str(link.get("query", ""))
        if link.get("datasourceUid") not in loki_uids:
            problems.append(f"{uid} datasource: no trace-to-logs link to Loki")
        elif not link.get("customQuery") or "trace_id=" not in query or "traceId" not in query:
            problems.append(f"{uid} datasource: trace-to-logs does not select the trace_id")
    for uid in loki_uids:
        fields = sources[uid].get("jsonData", {}).get("derivedFields", [])
        if not any(
            f.get("matcherRegex") == "trace_id" and f.get("datasourceUid") in sources
            for f in fields
        ):
            problems.append(f"{uid} datasource: a record's trace_id links to no trace")
    return problems


def trainer_user_problems(stack: Stack) -> list[str]:
    """The trainer writes its bind-mounted output as the host user, with a writable HOME."""
    problems = []
    trainer = services(stack).get("trainer", {})
    user = str(trainer.get("user", ""))
    if "${" not in user:
        problems.append(f"trainer: user {user!r} is not taken from the environment")
    dockerfile = stack["dockerfiles"].get("docker/trainer/Dockerfile", "")
    if not re.search(r"^ENV HOME=\S+", dockerfile, re.M) or "chmod 1777" not in dockerfile:
        problems.append("docker/trainer/Dockerfile: no HOME that any user may write")
    if re.search(r"^USER\s+(root|0)\b", dockerfile, re.M):
        problems.append("docker/trainer/Dockerfile: runs as root")
    return problems


# --- tests ---------------------------------------------------------------------------


def test_every_stack_file_parses() -> None:
    files = [COMPOSE_FILE, *sorted(p for p in DOCKER.rglob("*") if p.is_file())]
    parsed = 0
    for path in files:
        if path.suffix in (".yaml", ".yml"):
            assert isinstance(yaml.safe_load(path.read_text()), dict), path
            parsed += 1
        elif path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict), path
            parsed += 1
        else:
            assert path.name == "Dockerfile", f"{path}: no check knows this kind of file"
    assert parsed >= 8


def test_real_stack_has_no_problems(stack: Stack) -> None:
    problems = (
        pipeline_problems(stack["collector"])
        + pipeline_problems(stack["jaeger"])
        + image_problems(stack)
        + jaeger_version_problems(stack)
        + prometheus_version_problems(stack)
        + otelcol_version_problems(stack)
        + published_port_problems(stack)
        + wiring_problems(stack)
        + mount_problems(stack)
        + bucket_problems(stack)
        + dashboard_problems(stack)
        + jaeger_test_config_problems(stack)
        + expiration_problems(stack)
        + quantile_problems(stack)
        + trainer_user_problems(stack)
        + exemplar_problems(stack)
        + logs_problems(stack)
    )
    assert problems == []


def test_logs_check_catches_a_broken_path_to_loki(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    broken["collector"]["service"]["pipelines"]["logs"]["exporters"] = ["debug"]
    broken["loki"]["limits_config"]["allow_structured_metadata"] = False
    sources = {source["uid"]: source for source in broken["datasources"]["datasources"]}
    del sources["tempo"]["jsonData"]["tracesToLogsV2"]
    sources["jaeger"]["jsonData"]["tracesToLogsV2"]["query"] = '{service_name="x"}'
    sources["loki"]["jsonData"]["derivedFields"] = []
    assert logs_problems(broken) == [
        "collector: no logs pipeline from the OTLP receiver to Loki",
        "loki: allow_structured_metadata is not true (OTLP ingestion fails)",
        "jaeger datasource: trace-to-logs does not select the trace_id",
        "tempo datasource: no trace-to-logs link to Loki",
        "loki datasource: a record's trace_id links to no trace",
    ]
    broken["collector"]["exporters"]["otlphttp/loki"]["endpoint"] = "http://loki:3100/v1/logs"
    assert "collector exporter otlphttp/loki: Loki takes OTLP under /otlp" in logs_problems(broken)


def test_exemplar_check_catches_a_broken_link(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    broken["collector"]["exporters"]["prometheus"]["enable_open_metrics"] = False
    command = services(broken)["prometheus"]["command"]
    command[command.index("--enable-feature=exemplar-storage,native-histograms")] = (
        "--enable-feature=native-histograms"
    )
    sources = {source["uid"]: source for source in broken["datasources"]["datasources"]}
    sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"].pop()
    sources["jaeger"]["jsonData"]["tracesToMetrics"]["tags"].pop()
    assert exemplar_problems(broken) == [
        "collector prometheus exporter: enable_open_metrics is not true",
        "prometheus: --enable-feature=exemplar-storage missing",
        "prometheus datasource: exemplars do not link to Jaeger and Tempo",
        "jaeger datasource: traces-to-metrics not keyed by dflash.run.id",
    ]


def test_quantile_check_catches_octave_quantiles(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    del services(broken)["trainer"]["environment"][HISTOGRAM_VARIABLE]
    broken["collector"]["service"]["pipelines"]["metrics"]["exporters"] = ["prometheus"]
    command = services(broken)["prometheus"]["command"]
    command.remove("--web.enable-otlp-receiver")
    command[command.index("--enable-feature=exemplar-storage,native-histograms")] = (
        "--enable-feature=exemplar-storage"
    )
    del broken["prometheus"]["otlp"]["convert_histograms_to_nhcb"]
    p50 = dashboard_panel(broken, "p50")["targets"][0]
    p50["expr"] = p50["expr"].replace("(dflash_phase)", "(le, dflash_phase)")
    assert quantile_problems(broken) == [
        f"trainer: {HISTOGRAM_VARIABLE} is not base2_exponential_bucket_histogram",
        f"collector: the trainer's metrics do not reach Prometheus' {OTLP_PATH}",
        "prometheus: --web.enable-otlp-receiver missing",
        "prometheus: --enable-feature=native-histograms missing",
        "prometheus: otlp.convert_histograms_to_nhcb is not true",
        "dflash-train.json panel 'p50 per phase': quantile of"
        " dflash_phase_duration_seconds by (le, dflash_phase) is not native",
    ]


def test_expiration_check_catches_series_that_never_expire(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    del spanmetrics_config(broken)["metrics_expiration"]
    assert expiration_problems(broken) == [
        "spanmetrics: no metrics_expiration (finished runs' series live forever)"
    ]


def test_trainer_user_check_catches_a_fixed_uid(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    broken["compose"]["services"]["trainer"]["user"] = "10001"
    broken["dockerfiles"]["docker/trainer/Dockerfile"] = "FROM python:3.12\nUSER root\n"
    assert len(trainer_user_problems(broken)) == 3


def test_dockerignore_keeps_the_context_to_what_the_image_copies() -> None:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    dockerfile = (DOCKER / "trainer" / "Dockerfile").read_text()
    copied = {
        word.rstrip("/")
        for line in dockerfile.splitlines()
        if line.startswith("COPY ")
        for word in line.split()[1:-1]
    }
    assert "*" in lines and copied <= allowed, (copied, allowed)


def panel_targets(stack: Stack) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard panel's targets (not the variables or
    the datasources' per-span links)."""
    found = []
    for dashboard in stack["dashboards"].values():
        panels = list(dashboard.get("panels", []))
        for panel in panels:
            panels += panel.get("panels", [])  # collapsed rows nest their panels
            found += [(panel["title"], t["expr"]) for t in panel.get("targets", []) if "expr" in t]
    return found


def test_dashboard_covers_required_views(stack: Stack) -> None:
    queries = " ".join(q for _, q in panel_targets(stack))
    quantiles = re.findall(r"histogram_quantile\((0\.\d+), .*?rate\((\w+)\{", queries)
    assert set(quantiles) == {
        ("0.5", "dflash_phase_duration_seconds"),
        ("0.95", "dflash_phase_duration_seconds"),
    }
    assert re.search(r'dflash_steps_total\{[^}]*dflash_stage="target"', queries)  # batches/s
    for phase in ("hs_queue.wait", "batch_queue.wait", "hs_queue.put"):
        assert f'dflash_phase="{phase}"' in queries, phase
    for counter in ("train_skipped_steps", "cache_skipped_samples", "telemetry_spans"):
        assert f"dflash_{counter}_total{{" in queries, counter  # errors and skips


def test_every_panel_reads_the_runs_own_metrics(stack: Stack) -> None:
    """Span metrics count sampled spans only (a tenth at --trace-sample-ratio 0.1, none at
    --trace-level off): every panel reads the trainer's metrics, selected by service and
    run, so its figures hold whatever the sampling."""
    targets = panel_targets(stack)
    assert len(targets) >= 12
    for title, expr in targets:
        assert "traces_span_metrics" not in expr, title
        for selector in re.findall(r"dflash_\w+\{([^}]*)\}", expr):
            assert 'service_name="$service"' in selector, (title, selector)
            assert 'dflash_run_id=~"$run"' in selector, (title, selector)
    (dashboard,) = stack["dashboards"].values()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "traces_span_metrics" not in variables["service"]["definition"]


def stage_time(expr: str) -> tuple[str, set[str]]:
    """(wait phase, phases of the denominator) of one wait-share expression."""
    phase = (
        r'\(histogram_sum\(sum\(rate\(dflash_phase_duration_seconds\{[^}]*dflash_phase="([^"]+)"\}'
    )
    phase += r"\[\$__rate_interval\]\)\)\) or vector\(0\)\)"
    match = re.fullmatch(rf"\({phase} / \(((?:{phase}(?: \+ )?)+)\)\)", expr)
    assert match, expr
    return match[1], set(re.findall(phase, match[2]))


def test_wait_shares_divide_by_the_verdicts_stage_phases(stack: Stack) -> None:
    """A wait share is the wait over the time of the stage's phases, the phases by which
    dflash.observe.bottleneck tells a stage's threads (a cache-reading target's time is
    target.read, a streamed one's too)."""
    from dflash.observe.bottleneck import DRAFTER_PHASES, TARGET_PHASES

    stages = {"hs_queue.wait": set(DRAFTER_PHASES)}
    stages |= {wait: set(TARGET_PHASES) for wait in ("hs_queue.put", "batch_queue.wait")}
    panel = dashboard_panel(stack, "Wait shares")
    shares = dict(stage_time(target["expr"]) for target in panel["targets"])
    assert shares == stages
    bottleneck = dashboard_panel(stack, "Bottleneck")["targets"][0]["expr"]
    for target in panel["targets"]:  # the verdict's inputs are the panel's, verbatim
        assert target["expr"] in bottleneck, target["legendFormat"]


def test_pipeline_check_catches_undefined_components(stack: Stack) -> None:
    collector = copy.deepcopy(stack["collector"])
    collector["service"]["pipelines"]["traces"]["exporters"].append("otlp/zipkin")
    del collector["processors"]["batch"]
    collector["service"]["pipelines"]["metrics/spanmetrics"]["receivers"] = ["otlp"]
    problems = pipeline_problems(collector)
    assert "pipeline traces: exporter otlp/zipkin is not defined" in problems
    assert "pipeline traces: processor batch is not defined" in problems
    assert any("connector spanmetrics must be" in p for p in problems)
    jaeger = copy.deepcopy(stack["jaeger"])
    jaeger["service"]["extensions"].append("pprof")
    assert pipeline_problems(jaeger) == ["service.extensions: pprof is not defined"]


@pytest.mark.parametrize(
    "image", ["grafana/grafana", "grafana/grafana:latest", "grafana/grafana:main"]
)
def test_image_check_catches_unpinned(stack: Stack, image: str) -> None:
    broken = copy.deepcopy(stack)
    services(broken)["grafana"]["image"] = image
    assert image_problems(broken) == [f"service grafana: image {image} is not pinned to a version"]
    broken["dockerfiles"]["docker/trainer/Dockerfile"] = (
        "FROM python:3.12-slim AS base\nFROM python\n"
    )
    assert "docker/trainer/Dockerfile: image python is not pinned to a version" in image_problems(
        broken
    )


def test_jaeger_version_check_catches_drift(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    services(broken)["jaeger"]["image"] = "jaegertracing/jaeger:2.12.0"
    assert len(jaeger_version_problems(broken)) == 1


def test_prometheus_version_check_catches_drift(stack: Stack) -> None:
    assert prometheus_version_problems(stack) == []
    drifted = PROMETHEUS_GO_MOD.read_text().replace("v0.307.3", "v0.308.1")
    assert prometheus_version_problems(stack, drifted) == [
        "compose runs prom/prometheus:v3.7.3, tools/prometheus builds v3.8.1 (v0.308.1)"
    ]


def test_otelcol_version_check_catches_drift(stack: Stack) -> None:
    assert otelcol_version_problems(stack) == []
    drifted = OTELCOL_GO_MOD.read_text().replace("v0.140.1", "v0.141.0")
    assert otelcol_version_problems(stack, drifted) == [
        "compose runs otel/opentelemetry-collector-contrib:0.140.1, tools/otelcol builds "
        "contrib ['0.141.0']"
    ]


def test_port_checks_catch_disagreement(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    broken["collector"]["exporters"]["otlp/jaeger"]["endpoint"] = "jaeger:14250"
    broken["collector"]["exporters"]["otlp/tempo"]["endpoint"] = "tempo-db:4317"
    broken["prometheus"]["scrape_configs"][0]["static_configs"][0]["targets"] = [
        "otel-collector:9999"
    ]
    problems = wiring_problems(broken)
    assert any(
        p.startswith("collector exporter otlp/jaeger: jaeger does not listen on port 14250")
        for p in problems
    )
    assert "collector exporter otlp/tempo: host 'tempo-db' is not a compose service" in problems
    assert any(
        p.startswith("prometheus job spanmetrics: otel-collector does not listen on port 9999")
        for p in problems
    )

    broken = copy.deepcopy(stack)
    services(broken)["jaeger"]["environment"] = {}  # Jaeger back on localhost only
    assert any("unreachable from other containers" in p for p in wiring_problems(broken))
    assert any("localhost only" in p for p in published_port_problems(broken))

    broken = copy.deepcopy(stack)
    broken["tempo"]["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] = (
        "0.0.0.0:4320"
    )
    services(broken)["otel-collector"]["ports"].append("55679:55679")
    assert any(
        "port 4317 is not tempo's OTLP grpc port" in p or "tempo does not listen on port 4317" in p
        for p in wiring_problems(broken)
    )
    assert any("publishes 55679" in p for p in published_port_problems(broken))

    broken = copy.deepcopy(stack)
    command = services(broken)["trainer"]["command"]
    command[command.index("--otlp-protocol") + 1] = "http"
    assert any("is not the collector's OTLP http port" in p for p in wiring_problems(broken))


def test_datasource_check_catches_wrong_targets(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    by_type = {s["type"]: s for s in broken["datasources"]["datasources"]}
    by_type["tempo"]["url"] = "http://localhost:3200"
    by_type["prometheus"]["url"] = "http://tempo:3200"
    problems = wiring_problems(broken)
    assert "datasource Tempo: host 'localhost' is not a compose service" in problems
    assert any(
        p.startswith("datasource Prometheus: type prometheus points at tempo") for p in problems
    )


def test_mount_check_catches_missing_files(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    services(broken)["tempo"]["volumes"] = ["./docker/tempo/tempo.yaml:/etc/tempo/config.yaml:ro"]
    services(broken)["jaeger"]["command"] = ["--config=/etc/jaeger/other.yaml"]
    broken["dashboard_providers"]["providers"][0]["options"]["path"] = "/dashboards"
    problems = mount_problems(broken)
    assert "service tempo: mounts ./docker/tempo/tempo.yaml, which does not exist" in problems
    assert "service jaeger: --config=/etc/jaeger/other.yaml is not a mounted file" in problems
    assert "dashboard provider dflash-train: /dashboards not mounted" in problems


def test_bucket_check_catches_coarse_buckets(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    spanmetrics_config(broken)["histogram"]["explicit"]["buckets"] = ["2ms", "1ms", "15s"]
    problems = bucket_problems(broken)
    assert len(problems) == 3
    assert duration_ms("2500us") == pytest.approx(2.5) and duration_ms("1m30s") == 90_000


def test_dashboard_check_catches_wrong_metric_names(stack: Stack) -> None:
    # Renaming the connector's namespace or unit changes every emitted name.
    for mutate in (
        lambda s: spanmetrics_config(s).update(namespace="spanmetrics"),
        lambda s: spanmetrics_config(s)["histogram"].update(unit="s"),
        lambda s: s["collector"]["exporters"]["prometheus"].update(
            translation_strategy="UnderscoreEscapingWithoutSuffixes"
        ),
    ):
        broken = copy.deepcopy(stack)
        mutate(broken)
        assert any("is not emitted" in p for p in dashboard_problems(broken))

    broken = copy.deepcopy(stack)
    panel = next(iter(broken["dashboards"].values()))["panels"][0]
    panel["targets"][0]["expr"] = (
        'sum(rate(calls_total{service_name="x", span_name="hs_queue_wait", span_phase="y"}[1m]))'
    )
    problems = dashboard_problems(broken)
    assert any("metric calls_total is not emitted" in p for p in problems)
    assert any("label span_phase is not emitted" in p for p in problems)
    assert any("'hs_queue_wait' is not a dflash-train phase" in p for p in problems)


def test_emitted_names_follow_connector_and_exporter(stack: Stack) -> None:
    names, labels = emitted_metrics(stack)
    assert {
        "traces_span_metrics_calls_total",
        "traces_span_metrics_duration_milliseconds_bucket",
        "traces_span_metrics_duration_milliseconds_sum",
        "traces_span_metrics_duration_milliseconds_count",
        "dflash_tokens_total",
        "dflash_steps_total",
        "dflash_queue_size",
        "dflash_phase_duration_seconds",  # one native histogram (OTLP receiver)
        "dflash_train_loss",
        "dflash_train_acceptance_length",
        "dflash_train_mfu_ratio",
        "dflash_device_memory_peak_bytes",
    } <= names
    assert "dflash_phase_duration_seconds_bucket" not in names
    assert {"service_name", "span_name", "status_code", "le", "dflash_stage"} <= labels
    assert {"dflash_queue", "dflash_phase", "dflash_device"} <= labels
    assert "dflash_run_id" in labels


def test_app_metrics_need_the_metrics_pipeline_and_resource_labels(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    del broken["collector"]["service"]["pipelines"]["metrics"]
    assert any("dflash_tokens_total is not emitted" in p for p in dashboard_problems(broken))
    broken = copy.deepcopy(stack)
    del broken["prometheus"]["otlp"]["promote_all_resource_attributes"]
    assert any("label dflash_run_id is not emitted" in p for p in dashboard_problems(broken))
    broken = copy.deepcopy(stack)  # posted elsewhere than Prometheus' OTLP path
    broken["collector"]["exporters"]["otlphttp/prometheus"]["endpoint"] = "http://prometheus:9090"
    assert any("dflash_tokens_total is not emitted" in p for p in dashboard_problems(broken))
    broken = copy.deepcopy(stack)  # scraped again: classic series, not the native one
    broken["collector"]["service"]["pipelines"]["metrics"]["exporters"] = ["prometheus"]
    assert any(
        "dflash_phase_duration_seconds is not emitted" in p for p in dashboard_problems(broken)
    )
    broken = copy.deepcopy(stack)
    panel = next(iter(broken["dashboards"].values()))["panels"][-1]
    panel["targets"][0]["expr"] = 'max(dflash_train_loss{dflash_phase="drafter.lose"})'
    assert any("phase 'drafter.lose' is not" in p for p in dashboard_problems(broken))


def dashboard_panel(stack: Stack, title_start: str) -> dict[str, Any]:
    (dashboard,) = stack["dashboards"].values()
    return next(p for p in dashboard["panels"] if p["title"].startswith(title_start))


def test_dashboard_shows_the_run_metrics_with_a_run_selector(stack: Stack) -> None:
    queries = " ".join(q for _, q in prometheus_queries(stack))
    for metric in (
        "dflash_tokens_total",
        "dflash_queue_size",
        "dflash_train_loss",
        "dflash_train_acceptance_length",
        "dflash_phase_duration_seconds",
    ):
        assert re.search(rf"{metric}\{{[^}}]*dflash_run_id=~\"\$run\"", queries), metric
    (dashboard,) = stack["dashboards"].values()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "dflash_run_id" in variables["run"]["definition"]


def test_bottleneck_panel_follows_the_verdict_rule(stack: Stack) -> None:
    from dflash.observe.bottleneck import DEFAULT_THRESHOLD, WaitShares, verdict

    panel = dashboard_panel(stack, "Bottleneck")
    (target,) = panel["targets"]
    thresholds = {float(t) for t in re.findall(r">=\s*([\d.]+)", target["expr"])}
    assert thresholds == {DEFAULT_THRESHOLD}
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    texts = {int(code): option["text"] for code, option in mapping["options"].items()}
    high, low = DEFAULT_THRESHOLD + 0.1, 0.0
    cases = {  # the verdict's words for each code the query can return
        0: WaitShares(low, low, low),
        1: WaitShares(low, low, high),
        2: WaitShares(high, low, low),
        3: WaitShares(low, high, low),
    }
    for code, shares in cases.items():
        word = texts[code].split(":")[0]
        assert word in verdict(shares), (code, texts[code], verdict(shares))


def test_jaeger_test_config_check_catches_drift(stack: Stack) -> None:
    broken = copy.deepcopy(stack)
    broken["jaeger"]["extensions"]["jaeger_query"]["grpc"]["endpoint"] = (
        "${env:JAEGER_GRPC:-localhost:16685}"
    )
    services(broken)["jaeger"]["volumes"] = [
        "./docker/jaeger/all-in-one.yaml:/etc/jaeger/config.yaml:ro"
    ]
    problems = jaeger_test_config_problems(broken)
    assert len(problems) == 2
    assert "reads JAEGER_GRPC" in problems[1]


def test_dashboard_phase_names_are_the_trainers() -> None:
    """Every phase the dashboard queries is one the trainer records (dflash.names)."""
    from dflash import names

    text = (DOCKER / "grafana" / "dashboards" / "dflash-train.json").read_text()
    queried = set(re.findall(r'(?:span_name|dflash_phase)=\\"([^\\"]+)\\"', text))
    assert queried, "the dashboard queries no phase by name"
    assert queried <= set(names.SPANS), sorted(queried - set(names.SPANS))
