"""The real Prometheus scrapes the stack's collector; the dashboard's PromQL returns series.

Prometheus is built from tools/prometheus/go.mod (or taken from DFLASH_PROMETHEUS_BIN)
and runs docker/prometheus/prometheus.yml, with the compose file's flags, its targets
moved to the loopback ports of the collector started with the stack's own config and its
OTLP receiver on the port that collector pushes the trainer's metrics to. Without Go the tests skip;
with DFLASH_REQUIRE_PROMETHEUS=1 a missing Prometheus fails them.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from conftest import REPO_ROOT, JaegerProcess, die_with_parent
from run_metrics_sender import metrics_run
from test_collector_pipeline import Collector, load_stack_checks
from test_collector_pipeline import collector as collector  # the fixture, re-exported
from test_e2e_dflash import finish, train
from test_jaeger_otlp import unique_service

from dflash.observe.bottleneck import DEFAULT_THRESHOLD, WaitShares, verdict
from tracing.snapshot import BUCKETS_PER_OCTAVE, PhaseStats, StatsSnapshot

PROMETHEUS_CONFIG = REPO_ROOT / "docker" / "prometheus" / "prometheus.yml"
BUILD_SCRIPT = REPO_ROOT / "tools" / "prometheus" / "build.sh"
SCRAPE_S = 1


def prometheus_unavailable(reason: str) -> None:
    if os.environ.get("DFLASH_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(f"{reason} (DFLASH_REQUIRE_PROMETHEUS=1)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def prometheus_binary() -> Path:
    explicit = os.environ.get("DFLASH_PROMETHEUS_BIN")
    if explicit:
        return Path(explicit)
    if shutil.which("go") is None:
        prometheus_unavailable("Go is not installed: Prometheus is built from tools/prometheus")
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        prometheus_unavailable(f"tools/prometheus/build.sh failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def loopback_prometheus_config(ports: dict[str, int]) -> dict[str, Any]:
    """docker/prometheus/prometheus.yml, scraping the test's collector every second."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
    moved = {"8889": ports["prometheus"], "8888": ports["telemetry"]}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [
                f"127.0.0.1:{moved[t.rsplit(':', 1)[1]]}" for t in static["targets"]
            ]
    return config


@pytest.fixture
def prometheus(
    prometheus_binary: Path, collector: tuple[Collector, dict[str, int]], tmp_path: Path
) -> Iterator[str]:
    _, ports = collector
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(loopback_prometheus_config(ports)))
    port = ports["prometheus_server"]  # where the collector's otlphttp exporter posts
    log = (tmp_path / "prometheus.log").open("wb")
    flags = {"config.file": config, "storage.tsdb.path": tmp_path / "tsdb"}
    flags["web.listen-address"] = f"127.0.0.1:{port}"
    command = [str(prometheus_binary), *(f"--{k}={v}" for k, v in flags.items())]
    # The compose file's other flags (OTLP receiver, exemplar storage, native
    # histograms), as the stack runs it.
    stack = load_stack_checks().load_stack()
    ours = tuple(f"--{k}=" for k in flags)
    command += [
        f for f in stack["compose"]["services"]["prometheus"]["command"] if not f.startswith(ours)
    ]
    pipes = dict(stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    process = subprocess.Popen(command, **pipes, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                if requests.get(f"{url}/-/ready", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "Prometheus not ready in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


HISTOGRAM_VARIABLE = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
# The trainer's environment in the compose file: the stack's documented setting.
STACK_ENV = load_stack_checks().load_stack()["compose"]["services"]["trainer"]["environment"]


def query(url: str, promql: str) -> list[dict[str, Any]]:
    reply = requests.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert reply["status"] == "success", (promql, reply)
    return reply["data"]["result"]


def exemplar_trace_ids(url: str, selector: str) -> set[str]:
    """The trace ids of the exemplars Prometheus holds for `selector` (the last hour)."""
    now = time.time()
    params = {"query": selector, "start": now - 3600, "end": now}
    reply = requests.get(f"{url}/api/v1/query_exemplars", params=params, timeout=10).json()
    assert reply["status"] == "success", (selector, reply)
    return {
        exemplar["labels"]["trace_id"]
        for series in reply["data"]
        for exemplar in series["exemplars"]
        if "trace_id" in exemplar["labels"]
    }


def grafana_to_promql(expr: str, service: str, run: str) -> str:
    # label_values(selector, label) is Grafana's: its series are the selector's.
    expr = re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", expr)
    expr = expr.replace("$__rate_interval", f"{4 * SCRAPE_S}s")
    return expr.replace("$service", service).replace("$run", run)


def panels_without_data(url: str, stack: Any, service: str, run: str) -> list[str]:
    """Each panel target (title and refId) whose PromQL, as Grafana sends it for
    `service` and `run`, returns no series with a number (NaN: no phase in the window)."""
    empty = []
    for dashboard in stack["dashboards"].values():
        panels = list(dashboard["panels"])
        for panel in panels:
            panels += panel.get("panels", [])  # collapsed rows nest their panels
            for target in panel.get("targets", []):
                series = query(url, grafana_to_promql(target["expr"], service, run))
                if not any(math.isfinite(float(s["value"][1])) for s in series):
                    empty.append(f"{panel['title']!r} {target['refId']}")
    return empty


def run_ids(url: str, stack: Any, service: str) -> set[str]:
    """The dashboard's $run choices for `service`, from its own variable query."""
    (dashboard,) = stack["dashboards"].values()
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    label = re.fullmatch(r"label_values\(.*,\s*(\w+)\)", variable["definition"])
    assert label, variable["definition"]
    series = query(url, grafana_to_promql(variable["definition"], service, ".*"))
    return {s["metric"][label[1]] for s in series}


HIGH = DEFAULT_THRESHOLD + 0.15
SCENARIOS = {  # run id -> wait shares (target input, target output, drafter)
    "balanced": WaitShares(0.02, 0.02, 0.05),
    "target-bound": WaitShares(0.02, 0.02, HIGH),
    "input-bound": WaitShares(HIGH, 0.0, HIGH),
    "drafter-bound": WaitShares(0.02, HIGH, 0.02),
}
CODES = {0: "balanced", 1: "target-bound", 2: "input-bound", 3: "drafter-bound"}


def test_dashboard_queries_return_series_and_the_verdict(
    prometheus: str, collector: tuple[Collector, dict[str, int]]
) -> None:
    _, ports = collector
    service = unique_service("prom")
    endpoint = f"http://127.0.0.1:{ports['grpc']}"
    checks = load_stack_checks()
    stack = checks.load_stack()
    with (
        metrics_run(service, endpoint, "balanced", SCENARIOS["balanced"]),
        metrics_run(service, endpoint, "target-bound", SCENARIOS["target-bound"]),
        metrics_run(service, endpoint, "input-bound", SCENARIOS["input-bound"]),
        metrics_run(service, endpoint, "drafter-bound", SCENARIOS["drafter-bound"]),
    ):
        deadline = time.monotonic() + 60
        while not query(
            prometheus, f'rate(dflash_tokens_total{{service_name="{service}"}}[4s]) > 0'
        ):
            assert time.monotonic() < deadline, "no dflash metrics in Prometheus after 60 s"
            time.sleep(0.5)
        time.sleep(3 * SCRAPE_S)  # a few more scrapes: every rate() window has two samples
        empty = []
        for where, expr in checks.prometheus_queries(stack):
            if "traces_span_metrics" in expr or "$__tags" in expr:
                continue  # span metrics: no spans here (the collector test sends them);
                # trace-to-metrics links: Grafana fills $__tags from a span
            if not query(prometheus, grafana_to_promql(expr, service, ".*")):
                empty.append(where)
        assert empty == [], f"dashboard queries without series: {empty}"
        panels = [p for d in stack["dashboards"].values() for p in d["panels"]]
        panel = next(p for p in panels if p["title"].startswith("Bottleneck"))
        for run, shares in SCENARIOS.items():
            (series,) = query(
                prometheus, grafana_to_promql(panel["targets"][0]["expr"], service, run)
            )
            code = int(float(series["value"][1]))
            assert CODES[code] == run
            assert run in verdict(shares)  # the in-process verdict names the same stage
    runs = query(
        prometheus, f'count by (dflash_run_id) (dflash_train_loss{{service_name="{service}"}})'
    )
    assert {r["metric"]["dflash_run_id"] for r in runs} == set(SCENARIOS)


RUN_ID_RE = re.compile(r"^telemetry: .*, run (\S+)\)$", re.M)


def test_a_real_training_run_fills_every_dashboard_query(
    prometheus: str,
    collector: tuple[Collector, dict[str, int]],
    jaeger: JaegerProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`dflash-train train` itself (traces and metrics over OTLP gRPC to the stack's
    collector): every PromQL query of the dashboards returns series labelled with the
    run's own id; the exemplars of the span metrics (the traces' links to metrics) and
    of the phase histograms name traces that Jaeger holds."""
    _, ports = collector
    service = unique_service("prom-train")
    checks = load_stack_checks()
    stack = checks.load_stack()
    # Trace-to-metrics links of the datasources are filled per span by Grafana ($__tags);
    # a healthy run has no error spans to count.
    queries = checks.prometheus_queries(stack)
    per_span = ("$__tags", "STATUS_CODE_ERROR")
    dashboard_queries = [(w, e) for w, e in queries if not any(s in e for s in per_span)]

    def has_series(expr: str) -> bool:
        return bool(query(prometheus, grafana_to_promql(expr, service, ".*")))

    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")  # train() copies the environment
    monkeypatch.setenv(HISTOGRAM_VARIABLE, STACK_ENV[HISTOGRAM_VARIABLE])  # as the stack's
    otlp = ["--otlp-endpoint", f"http://127.0.0.1:{ports['grpc']}", "--otlp-protocol", "grpc"]
    process = train(tmp_path, service, *otlp, "--profile-interval", "5", steps=1_000_000)
    try:
        selectors = [
            f'traces_span_metrics_duration_milliseconds_bucket{{service_name="{service}"}}',
            f'dflash_phase_duration_seconds{{service_name="{service}"}}',
        ]
        deadline = time.monotonic() + 90
        while True:
            empty = [where for where, expr in dashboard_queries if not has_series(expr)]
            exemplars = {s: exemplar_trace_ids(prometheus, s) for s in selectors}
            done = not empty and all(exemplars.values())
            if done or process.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert process.poll() is None, "training ended early"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the run's normal end here: checkpoint, summary
        output = finish(process, tmp_path, returncode=143)
    assert empty == [], f"dashboard queries without series from a real run: {empty}"
    match = RUN_ID_RE.search(output)
    assert match, output[-3000:]
    runs = query(
        prometheus, f'count by (dflash_run_id) (dflash_tokens_total{{service_name="{service}"}})'
    )
    assert {r["metric"]["dflash_run_id"] for r in runs} == {match[1]}
    # The run's own health as metrics: no step skipped, its spans counted by outcome.
    skipped = query(prometheus, f'dflash_train_skipped_steps_total{{service_name="{service}"}}')
    assert skipped and all(float(r["value"][1]) == 0 for r in skipped), skipped
    spans = query(prometheus, f'dflash_telemetry_spans_total{{service_name="{service}"}}')
    by_outcome = {r["metric"]["dflash_outcome"]: float(r["value"][1]) for r in spans}
    assert set(by_outcome) == {"handed", "exported", "failed"}, spans
    assert by_outcome["exported"] > 0 and by_outcome["failed"] == 0, by_outcome
    assert all(exemplars.values()), f"no exemplars in Prometheus: {exemplars}"

    def trace(trace_id: str) -> list[Any]:
        try:
            return jaeger._get(f"traces/{trace_id}")
        except requests.HTTPError:  # 404 until Jaeger has it
            return []

    for selector, trace_ids in exemplars.items():  # the run has ended: its spans are in
        trace_id = sorted(trace_ids)[0]
        found = jaeger.wait_for(lambda t=trace_id: trace(t), bool, waiting_for=selector)
        assert found[0]["traceID"] == trace_id, (selector, trace_id)


def test_every_panel_has_data_from_a_run_without_traces(
    prometheus: str,
    collector: tuple[Collector, dict[str, int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At `--trace-level off` no span reaches the collector, so span metrics have nothing
    (and at `--trace-sample-ratio 0.1` a tenth): every panel of the dashboard, each of its
    queries as Grafana sends it for this service and run, still shows the run, because it
    reads the trainer's own metrics (every batch and phase)."""
    _, ports = collector
    service = unique_service("prom-untraced")
    stack = load_stack_checks().load_stack()
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")  # train() copies the environment
    monkeypatch.setenv(HISTOGRAM_VARIABLE, STACK_ENV[HISTOGRAM_VARIABLE])  # as the stack's
    otlp = ["--otlp-endpoint", f"http://127.0.0.1:{ports['grpc']}", "--otlp-protocol", "grpc"]
    process = train(tmp_path, service, *otlp, "--trace-level", "off", steps=1_000_000)
    try:
        deadline = time.monotonic() + 90
        while True:
            runs = run_ids(prometheus, stack, service)
            # The run's id as Grafana puts a single $run choice into `=~`.
            empty = [f"$run choices {runs}"] if len(runs) != 1 else []
            empty = empty or panels_without_data(prometheus, stack, service, *runs)
            if not empty or process.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert process.poll() is None, "training ended early"
        spans = query(prometheus, f'traces_span_metrics_calls_total{{service_name="{service}"}}')
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        output = finish(process, tmp_path, returncode=143)
    assert empty == [], f"panels without data from a run at --trace-level off: {empty}"
    assert spans == [], "span metrics from a run at --trace-level off"
    match = RUN_ID_RE.search(output)
    assert match and runs == {match[1]}, (runs, output[-3000:])
    assert re.fullmatch(r"[\w-]+", match[1])  # no regex characters for Grafana to escape


def octave_bound_quantile(stats: PhaseStats, q: float) -> float:
    """What Prometheus' histogram_quantile answered from the old octave bounds
    (tracing.metrics.PHASE_BOUNDS_S, the explicit histogram): the rank's bucket found
    among the octave counts, then linear interpolation between its bounds."""
    octaves: dict[int, int] = {}
    for bucket, n in stats.buckets.items():
        octave = bucket // BUCKETS_PER_OCTAVE
        octaves[octave] = octaves.get(octave, 0) + n
    rank, seen = q * stats.count, 0
    for octave in sorted(octaves):
        if seen + octaves[octave] >= rank:
            low, high = 2.0**octave, 2.0 ** (octave + 1)
            return low + (high - low) * (rank - seen) / octaves[octave]
        seen += octaves[octave]
    raise AssertionError(f"rank {rank} beyond the counts {octaves}")


ONE_BUCKET = 1 / BUCKETS_PER_OCTAVE  # in octaves: 2**(1/8), about 9 %


def test_phase_p50_in_prometheus_is_the_runs_own_within_one_bucket(
    prometheus: str,
    collector: tuple[Collector, dict[str, int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finished run at the stack's setting (the phase histogram exponential): for
    every phase, the p50 Prometheus computes from the native histogram it stored is
    within one bucket (1/8 octave, about 9 %) of the run's own median in stats.json
    (ProfileStats' bucket midpoint; of either middle duration when the count is
    even), where the old octave bounds were not (at least one phase further off)."""
    _, ports = collector
    service = unique_service("prom-p50")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")  # train() copies the environment
    monkeypatch.setenv(HISTOGRAM_VARIABLE, STACK_ENV[HISTOGRAM_VARIABLE])
    otlp = ["--otlp-endpoint", f"http://127.0.0.1:{ports['grpc']}", "--otlp-protocol", "grpc"]
    output = finish(train(tmp_path, service, *otlp, "--trace-level", "off", steps=40), tmp_path)
    (stats_file,) = (tmp_path / "run").rglob("stats.json")
    phases = {
        name: stats
        for name, stats in StatsSnapshot.from_dict(
            json.loads(stats_file.read_text())
        ).phases.items()
        if stats.count >= 20  # a median of a few durations says little either way
    }
    assert phases, output[-3000:]
    histogram = f'dflash_phase_duration_seconds{{service_name="{service}"}}'

    def counts() -> dict[str, float]:
        found = query(prometheus, f"histogram_count({histogram})")
        return {s["metric"]["dflash_phase"]: float(s["value"][1]) for s in found}

    # The final export (at the run's end) holds what stats.json holds.
    deadline = time.monotonic() + 30
    while any(counts().get(name) != s.count for name, s in phases.items()):
        assert time.monotonic() < deadline, (counts(), {n: s.count for n, s in phases.items()})
        time.sleep(0.5)
    errors, octave_errors = {}, {}
    for name, stats in phases.items():
        # The whole run's cumulative histogram, as stats.json: no rate() window.
        promql = f'histogram_quantile(0.5, {histogram[:-1]}, dflash_phase="{name}"}})'
        (series,) = query(prometheus, promql)
        p50 = float(series["value"][1])
        # An even count has two middle durations, and any value between is a median:
        # ProfileStats answers the lower one's bucket, Prometheus (counting down from
        # the top for q >= 0.5) the upper one's; across empty buckets they differ.
        middle = (stats.quantile_s(0.5), stats.quantile_s((stats.count // 2 + 0.5) / stats.count))
        errors[name] = min(abs(math.log2(p50 / m)) for m in middle)
        octave = octave_bound_quantile(stats, 0.5)
        octave_errors[name] = min(abs(math.log2(octave / m)) for m in middle)
    print(f"\np50 error in octaves, native: {errors}\noctave bounds: {octave_errors}")
    assert max(errors.values()) <= ONE_BUCKET, errors
    assert max(octave_errors.values()) > ONE_BUCKET, octave_errors
