"""--report-to against the real tools, each read back by its own means: the figures
equal metrics.jsonl's, step by step (every logged step, the eval_* figures of
--eval-every and the final evaluation's on the last line), with the config and the τ
curve.

- TensorBoard: its own reader (tensorboard.backend.event_processing) on the event files;
- MLflow: a real tracking server on loopback with its SQLite store (`mlflow server`),
  read through its REST API: the figures, the params, the drafter and the other
  artifacts, the run's traces (its OTLP endpoint); its run page rendered in headless
  Chromium (tests/chromium.py, as report.html's);
- W&B: offline (WANDB_MODE=offline); the run's .wandb file read with wandb's own
  protobuf records (wandb 0.31 ships no Python reader of the file, and no summary file
  offline).

Bad input: a tracking server that is down and a W&B run without network, in one run:
training ends as without them, one line each. The libraries are the `trackers` extra
(scripts/bootstrap.sh installs it); without them these tests skip, and fail under
DFLASH_REQUIRE_TRACKERS=1 (CI).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import pytest
import requests
from conftest import REPO_ROOT, die_with_parent, free_port
from test_e2e_dflash import FAST_FLAGS, checkout_env, dflash_train

from tests.chromium import headless

pytestmark = pytest.mark.slow

STEPS = 12
RUN_FLAGS = ("--steps", str(STEPS), "--log-every", "3", "--eval-every", "6", *FAST_FLAGS)
RUN_TIMEOUT_S = 600
SERVER_START_S = 180.0


def trackers_unavailable(reason: str) -> None:
    if os.environ.get("DFLASH_REQUIRE_TRACKERS") == "1":
        pytest.fail(f"{reason} (DFLASH_REQUIRE_TRACKERS=1: these tests must run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def _libraries() -> None:
    for module in ("tensorboard", "mlflow", "wandb"):
        if importlib.util.find_spec(module) is None:
            trackers_unavailable(f"{module}: pip install 'dflash-train[trackers]'")
    if importlib.util.find_spec("mlflow.server") is None:
        trackers_unavailable("mlflow's tracking server is not installed (pip install mlflow)")


# ----------------------------------------------------------------- the runs


def train(folder: Path, *extra: str, **env: str) -> str:
    """`dflash-train train` into `folder`/run: its output (exit code 0 asserted); the
    tools' variables of this process are not passed on (`env` sets them)."""
    clean = checkout_env(**env)
    for key in [k for k in clean if k.startswith(("WANDB_", "MLFLOW_")) and k not in env]:
        del clean[key]
    done = subprocess.run(
        [*dflash_train(), "train", "--output-dir", str(folder / "run"), *RUN_FLAGS, *extra],
        capture_output=True,
        text=True,
        env=clean,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return output


def flatten(line: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl line's numbers as the trackers name them: `name`, `name/index`
    (lists), `name/key` (mappings); written here again, not imported."""
    out: dict[str, float] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}/{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{key}/{i}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)

    for key, value in line.items():
        if key != "step":
            walk(key, value)
    return out


def expected_figures(run_dir: Path) -> dict[tuple[str, int], float]:
    """{(figure, step): value} of every line of metrics.jsonl, as the run left it."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3, 6, 9, 12], rows
    assert "eval_tau" in rows[2] and "eval_tau" in rows[-1]  # --eval-every, then the final
    return {(k, r["step"]): v for r in rows for k, v in flatten(r).items()}


def same(read: dict[tuple[str, int], float], expected: dict[tuple[str, int], float]) -> None:
    """Equal, value for value (NaN equals NaN); the messages name what differs."""
    missing, extra = sorted(set(expected) - set(read)), sorted(set(read) - set(expected))
    assert (missing, extra) == ([], []), f"missing {missing[:10]}, extra {extra[:10]}"
    differ = [
        (key, read[key], value)
        for key, value in expected.items()
        if not (read[key] == value or (math.isnan(read[key]) and math.isnan(value)))
    ]
    assert differ == []


@dataclass
class MlflowServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, endpoint: str, **params: Any) -> Any:
        url = f"{self.url}/api/2.0/mlflow/{endpoint}"
        response = requests.get(url, params=params, timeout=30)
        assert response.status_code == 200, response.text[:2000]
        return response.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = requests.post(f"{self.url}/api/{path}", json=body, timeout=30)
        assert response.status_code == 200, response.text[:2000]
        return response.json()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """`mlflow server` on a free loopback port with a fresh SQLite store."""
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{home / 'mlflow.db'}",
        "--artifacts-destination",
        str(home / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = home / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=home,
            # No job runner (GenAI evaluation jobs: seven more processes on two cores).
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    server = MlflowServer(f"http://127.0.0.1:{port}", process, log)
    try:
        started = time.monotonic()
        while True:
            if process.poll() is not None:
                pytest.fail(f"mlflow server exited:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() - started > SERVER_START_S:
                pytest.fail(
                    f"mlflow server not up in {SERVER_START_S:.0f} s:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        print(f"mlflow server up in {time.monotonic() - started:.1f} s")
        yield server
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@dataclass
class Reported:
    run_dir: Path
    output: str
    expected: dict[tuple[str, int], float]

    def closing(self, tool: str) -> str:
        (line,) = [x for x in self.output.splitlines() if x.startswith(f"report-to {tool}:")]
        return line


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory, mlflow_server: MlflowServer) -> Reported:
    """One run reported to all three tools, with the flags comma-separated and repeated."""
    folder = tmp_path_factory.mktemp("reported")
    started = time.monotonic()
    output = train(
        folder,
        "--report-to",
        "tensorboard,mlflow",
        "--report-to",
        "wandb",
        MLFLOW_TRACKING_URI=mlflow_server.url,
        MLFLOW_EXPERIMENT_NAME="dflash-train-tests",
        WANDB_MODE="offline",
        WANDB_PROJECT="dflash-train-tests",
    )
    print(f"run with three trackers: {time.monotonic() - started:.1f} s")
    run_dir = folder / "run"
    assert "warning: report-to" not in output, output[-3000:]
    return Reported(run_dir, output, expected_figures(run_dir))


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


# ----------------------------------------------------------------- TensorBoard


def float32(figures: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """The figures as TensorBoard keeps a scalar: rounded to float32."""
    return {key: float(numpy.float32(value)) for key, value in figures.items()}


def test_tensorboard_event_files_hold_the_figures_of_metrics_jsonl(reported: Reported) -> None:
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    log_dir = reported.run_dir / "tensorboard"
    accumulator = event_accumulator.EventAccumulator(
        str(log_dir),
        size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},
    )
    accumulator.Reload()
    read: dict[tuple[str, int], float] = {}
    summary: dict[str, float] = {}
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            if tag.startswith("summary/"):
                summary[tag] = event.value
            else:
                read[(tag, event.step)] = event.value  # the last event of a step wins
    same(read, float32(reported.expected))
    assert [step for (tag, step) in sorted(read) if tag == "eval_tau"] == [6, 12]  # τ curve
    texts = {
        tag: tensor_util.make_ndarray(accumulator.Tensors(tag)[-1].tensor_proto).item().decode()
        for tag in accumulator.Tags()["tensors"]
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "text"
    }
    config = json.loads(texts["config/text_summary"].replace("\n    ", "\n"))
    assert config == json.loads((reported.run_dir / "config.json").read_text())
    assert summary["summary/tau"] == float(numpy.float32(summary_of(reported.run_dir)["tau"]))
    assert f"{STEPS // 3 + 1} steps to {log_dir}" in reported.closing("tensorboard")


# ----------------------------------------------------------------- MLflow


def mlflow_ids(reported: Reported) -> tuple[str, str]:
    line = reported.closing("mlflow")
    match = re.search(r"/#/experiments/(\w+)/runs/(\w+)$", line)
    assert match is not None, line
    return match.group(1), match.group(2)


def test_mlflow_holds_the_figures_config_drafter_and_traces(
    reported: Reported, mlflow_server: MlflowServer
) -> None:
    experiment_id, run_id = mlflow_ids(reported)
    run = mlflow_server.get("runs/get", run_id=run_id)["run"]
    assert run["info"]["status"] == "FINISHED"
    assert run["info"]["run_name"] == "run"
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    run_label = tags["dflash.run.id"]
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", run_label), run_label
    experiment = mlflow_server.get("experiments/get", experiment_id=experiment_id)["experiment"]
    assert experiment["name"] == "dflash-train-tests"

    read: dict[tuple[str, int], float] = {}
    for key in sorted({key for key, _ in reported.expected}):
        history = mlflow_server.get("metrics/get-history", run_id=run_id, metric_key=key)
        for point in sorted(history["metrics"], key=lambda p: p["timestamp"]):
            read[(key, int(point["step"]))] = float(point["value"])
    same(read, reported.expected)
    latest = {m["key"]: m["value"] for m in run["data"]["metrics"]}
    assert latest["summary/tau"] == summary_of(reported.run_dir)["tau"]

    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    config = json.loads((reported.run_dir / "config.json").read_text())
    assert params["run.steps"] == str(STEPS) and params["data.seq_len"] == "64"
    assert params["telemetry.report_to"] == json.dumps(["tensorboard", "mlflow", "wandb"])
    assert len(params) == sum(len(v) for v in config.values() if isinstance(v, dict)) + 1

    root = mlflow_server.get("artifacts/list", run_id=run_id)["files"]
    assert {"config.json", "summary.json", "metrics.jsonl", "report.html", "drafter"} <= {
        f["path"] for f in root
    }
    drafter = mlflow_server.get("artifacts/list", run_id=run_id, path="drafter")["files"]
    local = reported.run_dir / "drafter"
    assert {(f["path"], f["file_size"]) for f in drafter} == {
        (f"drafter/{p.name}", p.stat().st_size) for p in local.iterdir()
    }

    # The run's spans, through MLflow's OTLP endpoint: traces linked to the run.
    where = {"type": "MLFLOW_EXPERIMENT", "mlflow_experiment": {"experiment_id": experiment_id}}
    found = mlflow_server.post(
        "3.0/mlflow/traces/search",
        {"locations": [where], "filter": f"attribute.run_id = '{run_id}'", "max_results": 500},
    )["traces"]
    assert {t["tags"]["dflash.run.id"] for t in found} == {run_label}
    spans = []
    for trace in found:
        artifact = requests.get(
            f"{mlflow_server.url}/ajax-api/3.0/mlflow/get-trace-artifact",
            params={"request_id": trace["trace_id"]},
            timeout=30,
        ).json()
        spans += artifact["spans"]
    names = [s["name"] for s in spans]
    assert names.count("batch") == STEPS, sorted(set(names))
    assert {"drafter.step", "target.forward", "run.startup", "eval"} <= set(names)
    print(f"mlflow: {len(found)} traces, {len(spans)} spans of the run")


def test_mlflow_run_page_renders_in_headless_chromium(
    reported: Reported, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    experiment_id, run_id = mlflow_ids(reported)
    page = f"{mlflow_server.url}/#/experiments/{experiment_id}/runs/{run_id}"
    done = headless("--virtual-time-budget=20000", "--dump-dom", page)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    for text in ("dflash-train-tests", run_id, "eval_tau", "tau_estimate", "loss", "Finished"):
        assert text in dom, text
    shot = tmp_path / "mlflow-run.png"
    done = headless(
        "--virtual-time-budget=20000", "--window-size=1400,1100", f"--screenshot={shot}", page
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"MLflow's run page: {shot}")


# ----------------------------------------------------------------- W&B


def wandb_records(path: Path) -> list[Any]:
    """The records of a .wandb file, parsed with wandb's own protobuf schema. The file is
    a W&B header (':W&B', magic, version: 7 bytes) and LevelDB-log framed records in
    32 KiB blocks (each chunk: CRC, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, position, pending, records = 32 * 1024, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # the block's tail is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            position += left - 7
            continue
        if kind == 1:
            pending, chunk = b"", payload
        elif kind == 2:
            pending = payload
            continue
        elif kind == 3:
            pending += payload
            continue
        else:
            pending, chunk = b"", pending + payload
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def test_wandb_offline_run_holds_the_figures_and_config(reported: Reported) -> None:
    (run_file,) = (reported.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    read: dict[tuple[str, int], float] = {}
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            step = int(row.pop("_step"))
            for key, value in row.items():
                if not key.startswith("_"):
                    read[(key, step)] = float(value)
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run":
            for item in record.run.config.update:
                config[item.key] = json.loads(item.value_json)
    same(read, reported.expected)
    assert summary["summary/tau"] == summary_of(reported.run_dir)["tau"]
    saved = json.loads((reported.run_dir / "config.json").read_text())
    assert {k: v for k, v in config.items() if k in saved} == saved
    assert "offline" in reported.closing("wandb") and "wandb sync" in reported.closing("wandb")


# ----------------------------------------------------------------- bad input


def test_a_server_that_is_down_and_wandb_without_network_leave_training_whole(
    tmp_path: Path,
) -> None:
    """MLflow's tracking server down (a closed loopback port) and W&B with an API key but
    no network (its base URL a closed loopback port; no WANDB_MODE): the run ends as it
    would without them, one line each, bounded."""
    closed = free_port()
    started = time.monotonic()
    output = train(
        tmp_path,
        "--report-to",
        "mlflow,wandb",
        MLFLOW_TRACKING_URI=f"http://127.0.0.1:{closed}",
        WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}",
        WANDB_API_KEY="x" * 40,
    )
    wall_s = time.monotonic() - started
    run_dir = tmp_path / "run"
    summary = summary_of(run_dir)
    assert summary["steps"] == STEPS and summary["tau"] is not None
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    expected_figures(run_dir)  # metrics.jsonl whole

    lines = output.splitlines()
    mlflow_lines = [x for x in lines if "report-to mlflow" in x]
    assert len([x for x in mlflow_lines if x.startswith("warning:")]) == 1, mlflow_lines
    assert mlflow_lines[0].startswith(
        f"warning: report-to mlflow: http://127.0.0.1:{closed} failed (Connection refused; "
    )
    assert "training goes on" in mlflow_lines[0]
    assert mlflow_lines[-1].startswith(f"report-to mlflow: 0 of {STEPS // 3 + 1} steps delivered")
    assert len(mlflow_lines) == 2, mlflow_lines
    assert "Traceback" not in output

    offline = [x for x in lines if "offline mode" in x]
    assert len(offline) == 1, output[-3000:]  # said once
    assert offline[0].startswith("report-to wandb: no network to http://127.0.0.1:")
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert "report-to wandb: 5 steps to" in output
    print(f"run with a tracking server down and W&B offline: {wall_s:.1f} s")


# ----------------------------------------------------------------- the docs' commands

DOCS = REPO_ROOT / "docs" / "observability.md"
MLFLOW_PORT = 5000  # the documented one
PORT_LOCK = Path("/tmp/dflash-train-mlflow-5000.lock")
# The documented commands run literally; the environment only makes the run short.
SHORT = {
    "DFLASH_STEPS": str(STEPS),
    "DFLASH_LOG_EVERY": "3",
    "DFLASH_EVAL_EVERY": "6",
    "DFLASH_BATCH_SIZE": "2",
    "DFLASH_SEQ_LEN": "64",
    "DFLASH_EVAL_PROMPTS": "1",
    "DFLASH_EVAL_NEW_TOKENS": "8",
}


def documented_commands() -> list[str]:
    """The commands of the --report-to section's first code block, comments removed."""
    section = DOCS.read_text().split("`--report-to`\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match is not None, "docs/observability.md: no bash block in the --report-to section"
    return [line.split("  #")[0].strip() for line in match.group(1).splitlines() if line.strip()]


def as_argv(command: str) -> tuple[list[str], dict[str, str]]:
    """(argv as this checkout runs it, the command's own VAR=value assignments)."""
    words = shlex.split(command)
    assigned = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        assigned[key] = value
    programs = {
        "dflash-train": dflash_train(),
        "tensorboard": [sys.executable, "-m", "tensorboard.main"],
        "mlflow": [sys.executable, "-m", "mlflow"],
    }
    assert words[0] in programs, f"docs/observability.md shows an untested command: {command}"
    return [*programs[words[0]], *words[1:]], assigned


def doc_env(assigned: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in checkout_env().items()
        if not k.startswith(("WANDB_", "MLFLOW_", "DFLASH_", "OTEL_"))
    }
    return {**env, **SHORT, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **assigned}


@pytest.fixture
def mlflow_port() -> Iterator[None]:
    """This machine's turn on the documented port 5000 (other test sessions wait)."""
    with PORT_LOCK.open("a") as lock:
        deadline = time.monotonic() + 600
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    trackers_unavailable(f"{PORT_LOCK} stayed locked for 600 s")
                time.sleep(1)
        try:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", MLFLOW_PORT))
                except OSError:
                    trackers_unavailable(f"port {MLFLOW_PORT} is in use on this machine")
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Background:
    """A documented server command, started in its own process group."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def wait_for(self, pattern: str, timeout_s: float = SERVER_START_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log.read_text(errors="replace"))
            if found:
                return found
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.3)
        raise AssertionError(f"{pattern!r} not seen:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def test_the_documented_commands_run_literally(tmp_path: Path, mlflow_port: None) -> None:
    """docs/observability.md's --report-to block, each line as written, in one folder:
    a run to all three tools (MLflow's default store, W&B offline without a key),
    TensorBoard's UI on its files, MLflow's server on ./mlflow.db, a run to it."""
    commands = documented_commands()
    assert [c.split()[0] for c in commands] == [
        "dflash-train",
        "tensorboard",
        "mlflow",
        "MLFLOW_TRACKING_URI=http://localhost:5000",
    ], commands

    argv, assigned = as_argv(commands[0])
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env=doc_env(assigned),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    run_dir = tmp_path / "runs" / "default"
    expected = expected_figures(run_dir)
    assert "warning:" not in output, output[-3000:]
    offline = [x for x in output.splitlines() if "offline mode" in x]
    assert len(offline) == 1 and "no W&B API key" in offline[0], offline
    assert (tmp_path / "mlflow.db").is_file()  # MLflow's default store

    argv, assigned = as_argv(commands[1])
    board = Background(argv, tmp_path, doc_env(assigned), tmp_path / "tensorboard.log")
    try:
        url = board.wait_for(r"TensorBoard [\d.]+ at (http://localhost:\d+/)").group(1)
        deadline = time.monotonic() + 60
        while not (tags := requests.get(f"{url}data/plugin/scalars/tags", timeout=30).json()):
            assert time.monotonic() < deadline, "TensorBoard loaded no scalars in 60 s"
            time.sleep(0.5)  # it reads the files after it starts answering
        (run_tags,) = tags.values()
        assert {"loss", "eval_tau", "tau_estimate"} <= set(run_tags), sorted(run_tags)
        (run_name,) = tags
        points = requests.get(
            f"{url}data/plugin/scalars/scalars",
            params={"run": run_name, "tag": "eval_tau"},
            timeout=30,
        ).json()
        assert [(p[1], p[2]) for p in points] == [
            (step, value)
            for (key, step), value in sorted(float32(expected).items())
            if key == "eval_tau"
        ]
    finally:
        board.stop()

    argv, assigned = as_argv(commands[2])
    server = Background(argv, tmp_path, doc_env(assigned), tmp_path / "mlflow.log")
    try:
        url = f"http://localhost:{MLFLOW_PORT}"
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert server.process.poll() is None, server.log.read_text()[-3000:]
            assert time.monotonic() < deadline, server.log.read_text()[-3000:]
            time.sleep(0.5)
        argv, assigned = as_argv(commands[3])
        done = subprocess.run(
            argv,
            cwd=tmp_path,
            env=doc_env(assigned),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-4000:]
        assert "warning:" not in output, output[-3000:]
        rest = MlflowServer(url, server.process, server.log)
        found = rest.post(
            "2.0/mlflow/runs/search",
            {
                "experiment_ids": [
                    rest.get("experiments/get-by-name", experiment_name="dflash-train")[
                        "experiment"
                    ]["experiment_id"]
                ]
            },
        )["runs"]
        by_name = {r["info"]["run_name"]: r for r in found}
        assert set(by_name) == {"default", "mlflow"}  # the first run's too: same ./mlflow.db
        for name, folder in (("default", run_dir), ("mlflow", tmp_path / "runs" / "mlflow")):
            run = by_name[name]
            assert run["info"]["status"] == "FINISHED"
            latest = {m["key"]: m["value"] for m in run["data"]["metrics"]}
            last = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
            assert latest["eval_tau"] == last["eval_tau"] and latest["loss"] == last["loss"]
            files = rest.get("artifacts/list", run_id=run["info"]["run_id"], path="drafter")
            assert {f["path"] for f in files["files"]} >= {"drafter/model.safetensors"}
        run_id = by_name["mlflow"]["info"]["run_id"]
        where = {
            "type": "MLFLOW_EXPERIMENT",
            "mlflow_experiment": {"experiment_id": by_name["mlflow"]["info"]["experiment_id"]},
        }
        traces = rest.post(
            "3.0/mlflow/traces/search",
            {"locations": [where], "filter": f"attribute.run_id = '{run_id}'", "max_results": 500},
        )["traces"]
        assert len(traces) > STEPS, len(traces)  # a trace per batch, and the start-up's
    finally:
        server.stop()
