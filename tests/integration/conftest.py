"""Fixtures that run the real Jaeger (v2) for the integration tests.

The binary comes from DFLASH_JAEGER_BIN (scripts/test.sh sets it) or is built from
the Go module pinned in tools/jaeger. It runs with docker/jaeger/config.yaml, the
very file the compose stack mounts, with every port moved to a free loopback port
through the file's `${env:...}` placeholders. Without Go the tests skip with a
reason; with DFLASH_REQUIRE_JAEGER=1 (CI) a missing Jaeger fails them instead.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

# Short chat prompts the serving tests send (llama-server all of them, vLLM the first 8).
CHAT_PROMPTS = [
    "Write a Python function that adds two numbers.",
    "What is a prime number?",
    "Name three colors.",
    "Explain recursion in one sentence.",
    "How do I reverse a list in Python?",
    "What does HTTP stand for?",
    "Give me a haiku about the sea.",
    "What is 12 times 12?",
    "Describe a cat.",
    "Why is the sky blue?",
    "What is a linked list?",
    "Say hello in French.",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
JAEGER_CONFIG = REPO_ROOT / "docker" / "jaeger" / "config.yaml"
BUILD_SCRIPT = REPO_ROOT / "tools" / "jaeger" / "build.sh"
BUILD_TIMEOUT_S = 1800
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


def jaeger_unavailable(reason: str) -> None:
    """Skips the test, or fails it where CI demands the real Jaeger."""
    if os.environ.get("DFLASH_REQUIRE_JAEGER") == "1":
        pytest.fail(f"{reason} (DFLASH_REQUIRE_JAEGER=1: the Jaeger tests must run)", pytrace=False)
    pytest.skip(reason)


def find_jaeger_binary() -> Path:
    """DFLASH_JAEGER_BIN, else the cached build of tools/jaeger (building it once)."""
    explicit = os.environ.get("DFLASH_JAEGER_BIN")
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            jaeger_unavailable(f"DFLASH_JAEGER_BIN={explicit} is not an executable file")
        return path
    if shutil.which("go") is None:
        jaeger_unavailable(
            "Go is not installed: the real Jaeger is built from tools/jaeger/go.mod "
            "(install Go, or set DFLASH_JAEGER_BIN to a Jaeger v2 binary)"
        )
    try:
        done = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        jaeger_unavailable(f"building Jaeger took longer than {BUILD_TIMEOUT_S} s")
    if done.returncode != 0:
        jaeger_unavailable(f"tools/jaeger/build.sh failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def die_with_parent() -> None:
    """Runs in the child before exec: the kernel kills it if pytest dies without teardown."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def free_port() -> int:
    # The kernel picks an unused port; the tiny window before Jaeger binds it again
    # is acceptable for tests on one machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class JaegerPorts:
    otlp_grpc: int
    otlp_http: int
    query_http: int
    query_grpc: int
    health: int
    metrics: int

    @classmethod
    def pick(cls) -> JaegerPorts:
        return cls(*(free_port() for _ in range(6)))

    def environment(self) -> dict[str, str]:
        """The variables docker/jaeger/config.yaml reads its listen addresses from."""
        return {
            "JAEGER_LISTEN_HOST": "127.0.0.1",
            "JAEGER_OTLP_GRPC_PORT": str(self.otlp_grpc),
            "JAEGER_OTLP_HTTP_PORT": str(self.otlp_http),
            "JAEGER_QUERY_HTTP_PORT": str(self.query_http),
            "JAEGER_QUERY_GRPC_PORT": str(self.query_grpc),
            "JAEGER_HEALTH_PORT": str(self.health),
            "JAEGER_METRICS_PORT": str(self.metrics),
        }


class JaegerProcess:
    """One real Jaeger process; `stop()` then `start()` brings it back on the same ports."""

    def __init__(self, binary: Path, log_path: Path, config: Path = JAEGER_CONFIG) -> None:
        self.binary = binary
        self.config = config
        self.log_path = log_path
        self.ports = JaegerPorts.pick()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.otlp_grpc}"

    @property
    def otlp_http_endpoint(self) -> str:
        """Base URL; the OTLP/HTTP traces path is /v1/traces under it."""
        return f"http://127.0.0.1:{self.ports.otlp_http}"

    @property
    def query_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.query_http}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        assert not self.running, "Jaeger is already running"
        env = {**os.environ, **self.ports.environment()}
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [str(self.binary), "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=die_with_parent,
            )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminates the process (SIGTERM, then SIGKILL); idempotent."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        health_url = f"http://127.0.0.1:{self.ports.health}/status"
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"Jaeger exited during startup:\n{self.log_tail()}")
            try:
                healthy = requests.get(health_url, timeout=1).status_code == 200
                if healthy and requests.get(self._api("services"), timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"Jaeger not healthy after {timeout_s} s:\n{self.log_tail()}")

    # --- query API -------------------------------------------------------------

    def _api(self, path: str) -> str:
        return f"{self.query_url}/api/{path}"

    def _get(self, path: str, **params: Any) -> Any:
        response = requests.get(self._api(path), params=params, timeout=10)
        response.raise_for_status()
        return response.json()["data"]

    def services(self) -> list[str]:
        return self._get("services") or []

    def operations(self, service: str) -> list[str]:
        """Operation (span) names Jaeger has seen for `service`."""
        return sorted({op["name"] for op in self._get("operations", service=service) or []})

    def traces(self, service: str, limit: int = 1000, **params: Any) -> list[dict[str, Any]]:
        """Traces of `service` in Jaeger's UI JSON (spans, references, processes)."""
        return self._get("traces", service=service, limit=limit, lookback="1h", **params) or []

    def transform(self, otlp_json: bytes) -> list[dict[str, Any]]:
        """Jaeger's OTLP/JSON -> Jaeger UI JSON conversion (what the UI's file upload uses)."""
        response = requests.post(self._api("transform"), data=otlp_json, timeout=30)
        response.raise_for_status()
        return response.json()["data"] or []

    def wait_for(
        self,
        fetch: Callable[[], list[Any]],
        done: Callable[[list[Any]], bool],
        timeout_s: float = 30.0,
        waiting_for: str = "the expected data",
    ) -> list[Any]:
        """Polls `fetch` until `done(result)`; Jaeger's pipeline batches, so data lags."""
        deadline = time.monotonic() + timeout_s
        result = fetch()
        while not done(result):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {waiting_for} in Jaeger after {timeout_s} s; last: {result!r:.2000}"
                )
            time.sleep(0.2)
            result = fetch()
        return result


@pytest.fixture(scope="session")
def jaeger_binary() -> Path:
    return find_jaeger_binary()


@pytest.fixture(scope="session")
def jaeger(
    jaeger_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JaegerProcess]:
    """A Jaeger shared by the session: isolate tests by giving each its own service name."""
    process = JaegerProcess(jaeger_binary, tmp_path_factory.mktemp("jaeger") / "jaeger.log")
    try:
        process.start()
        yield process
    finally:
        process.stop()


@pytest.fixture
def own_jaeger(jaeger_binary: Path, tmp_path: Path) -> Iterator[JaegerProcess]:
    """A Jaeger for one test alone, which may stop and restart it."""
    process = JaegerProcess(jaeger_binary, tmp_path / "jaeger.log")
    try:
        process.start()
        yield process
    finally:
        process.stop()
