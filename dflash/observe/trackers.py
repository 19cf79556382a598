"""--report-to: a run's figures where ML engineers look (TensorBoard, MLflow, W&B).

Each tool is one small class behind the `Tracker` protocol, written against the tool's
own library, imported on first use: none of them is a dependency of the core install
(`pip install 'dflash-train[trackers]'` installs all three). What each one gets:

    tensorboard  OUTPUT_DIR/tensorboard/: every figure as a scalar by step (float32, the
                 precision TensorBoard keeps and shows), the config and the summary as
                 text (torch.utils.tensorboard.SummaryWriter)
    mlflow       a run in MLFLOW_EXPERIMENT_NAME (default `dflash-train`) of the tracking
                 server MLFLOW_TRACKING_URI names (else MLflow's default store): the
                 figures as metrics by step, the config as params and config.json, then
                 the drafter, report.html, metrics.jsonl and summary.json as artifacts;
                 the run's spans go to the server's OTLP endpoint (/v1/traces) beside them
    wandb        a run in WANDB_PROJECT (default `dflash-train`), files under
                 OUTPUT_DIR/wandb/ (WANDB_DIR overrides); offline when W&B cannot be
                 reached or no API key is set, said once (`wandb sync` uploads it later)

The figures are those of metrics.jsonl: every logged step's numeric figures (a list or
a mapping flattened to `name/index` or `name/key`), the eval_* figures of --eval-every,
and the final evaluation's that join the last line (`log_amended`); the τ curve is
`eval_tau` (held-out) and `tau_estimate` (training) by step. The summary's top-level
numbers follow as `summary/NAME`.

`Reporting` drives the trackers of a run (rank 0). Each tracker has a thread of its own,
so a slow or unreachable tool never stalls a training step: its first failure is one
line, it is not tried again for RETRY_AFTER_S, what it could not take is counted, and
`close` waits for it only while it makes progress (IDLE_BOUND_S). Training's own files
are never affected.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlparse

from dflash.config.checks import REPORT_TOOLS
from dflash.errors import DFlashError, first_line
from dflash.summary import JSON

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter

Say = Callable[[str], None]
# A metrics.jsonl line or the summary: JSON values, read by key ("step" is an int).
# Any, because a JSON value's type is known only when it is read.
Line = Mapping[str, Any]
# The arguments of a Tracker method, queued with its kind: each kind's are typed where
# Reporting puts them, and Any lets one queue carry every method's.
Args = tuple[Any, ...]
_T = TypeVar("_T")

RETRY_AFTER_S = 30.0  # a tool that failed is left alone this long, then tried again
IDLE_BOUND_S = 20.0  # close: how long a tool may go without finishing an item
CLOSE_CAP_S = 600.0  # close: the most it waits for a tool that keeps making progress
QUEUE_ITEMS = 10_000  # items waiting for one tool; past that they are dropped, counted
DEFAULT_PROJECT = "dflash-train"  # MLflow experiment and W&B project unless set
SPAN_WAIT_S = 1.0  # the MLflow span exporter's poll while the run is not made yet

# MLflow's own variables, bounded unless the user set them: a server that is down is
# told in seconds, not after MLflow's 7 retries with exponential backoff.
MLFLOW_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # the closing line names the run
}


class TrackerError(DFlashError):
    """--report-to names a tool whose library is not installed (one line, exit 2)."""


@dataclass(frozen=True)
class Tool:
    name: str
    module: str  # what must be importable
    package: str  # what pip installs (pinned by the `trackers` extra)
    title: str


TOOLS = {
    "tensorboard": Tool("tensorboard", "tensorboard", "tensorboard", "TensorBoard"),
    "mlflow": Tool("mlflow", "mlflow", "mlflow", "MLflow"),
    "wandb": Tool("wandb", "wandb", "wandb", "W&B"),
}
assert tuple(TOOLS) == REPORT_TOOLS


def wanted(report_to: Iterable[str]) -> list[str]:
    """The tools of a --report-to value (`none`: none), each once."""
    return [name for name in dict.fromkeys(report_to) if name != "none"]


def pinned(package: str) -> str:
    """`package==VERSION` as the `trackers` extra pins it (the bare name where dflash-train
    is not installed with its metadata)."""
    try:
        requires = importlib.metadata.requires("dflash-train") or []
    except importlib.metadata.PackageNotFoundError:
        return package
    for requirement in requires:
        spec, _, marker = requirement.partition(";")
        name = re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0]
        if name.lower() == package.lower() and "trackers" in marker:
            return spec.strip().replace(" ", "")
    return package


def check_installed(report_to: Iterable[str]) -> None:
    """Before any model loads: each tool's library is importable, else one TrackerError
    naming the package to install (found without importing it: --help stays quick)."""
    for name in wanted(report_to):
        tool = TOOLS[name]
        try:
            found = importlib.util.find_spec(tool.module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise TrackerError(
                f"--report-to {name}: {tool.title}'s library is not installed: pip install "
                f"{pinned(tool.package)} (all three: pip install 'dflash-train[trackers]')"
            )


def numeric_figures(
    figures: Mapping[str, object], skip: Sequence[str] = ("step",)
) -> dict[str, float]:
    """The numbers of a metrics.jsonl line by name: lists and mappings flattened to
    `name/index` and `name/key`; text, booleans and nulls left out."""
    out: dict[str, float] = {}

    def walk(key: str, value: object) -> None:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, Mapping):
            for sub, item in value.items():
                walk(f"{key}/{sub}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{key}/{index}", item)

    for key, value in figures.items():
        if key not in skip:
            walk(str(key), value)
    return out


def summary_figures(summary: Mapping[str, object]) -> dict[str, float]:
    """`summary/NAME` for the summary's top-level numbers (and lists of numbers)."""
    top = {
        key: value
        for key, value in summary.items()
        if not isinstance(value, (Mapping, str)) and value is not None
    }
    return {f"summary/{key}": value for key, value in numeric_figures(top, skip=()).items()}


@dataclass(frozen=True)
class RunStart:
    """What a tracker is told when the run's checks have passed."""

    config: Line
    run_id: str  # dflash.run.id: the run's traces carry it too
    output_dir: Path
    first_step: int = 0  # > 0 when resumed
    name: str = ""

    @property
    def title(self) -> str:
        return self.name or self.output_dir.resolve().name


@dataclass(frozen=True)
class RunEnd:
    """What a tracker is told at the end: status finished, interrupted or failed."""

    status: str
    summary: Line | None = None
    drafter_dir: Path | None = None
    files: tuple[Path, ...] = ()


class Tracker(Protocol):
    """One tool. Every method runs on the tool's own thread (`Reporting`), in order:
    `prepare` at once (its library's import, seconds, while the models load), `begin`
    once the run's checks have passed, then the steps, `finish` at the end."""

    name: str

    def prepare(self) -> None: ...

    def begin(self, run: RunStart, say: Say) -> None: ...

    def log_step(self, step: int, figures: Mapping[str, float]) -> None: ...

    def finish(self, end: RunEnd) -> None: ...

    def where(self) -> str: ...


# ----------------------------------------------------------------- the tools


class TensorBoardTracker:
    """OUTPUT_DIR/tensorboard/ through torch.utils.tensorboard: scalars (float32: float64
    tensors, which torch can write, are not shown by TensorBoard's data server). A
    resumed run's writer purges the steps after its checkpoint that the abandoned
    continuation had written."""

    name = "tensorboard"

    def __init__(self) -> None:
        self.writer: Any = None  # torch's SummaryWriter: imported late (the trackers extra)
        self.log_dir: Path | None = None
        self.step = 0

    def prepare(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # deferred: the trackers extra

        self.make_writer = SummaryWriter

    def begin(self, run: RunStart, say: Say) -> None:
        self.prepare()
        self.log_dir = run.output_dir / "tensorboard"
        purge = run.first_step + 1 if run.first_step else None
        self.writer = self.make_writer(str(self.log_dir), purge_step=purge, flush_secs=10)
        text = json.dumps(run.config, indent=2, sort_keys=True)
        self.writer.add_text("config", _markdown_code(text), run.first_step)
        self.writer.flush()

    def log_step(self, step: int, figures: Mapping[str, float]) -> None:
        for key, value in figures.items():
            self.writer.add_scalar(key, value, step)
        self.step = max(self.step, step)

    def finish(self, end: RunEnd) -> None:
        if end.summary is not None:
            for key, value in summary_figures(end.summary).items():
                self.writer.add_scalar(key, value, self.step)
            text = json.dumps(end.summary, indent=2, sort_keys=True, default=str)
            self.writer.add_text("summary", _markdown_code(text), self.step)
        self.writer.close()

    def where(self) -> str:
        return f"{self.log_dir} (tensorboard --logdir {self.log_dir})"


def _markdown_code(text: str) -> str:
    """Text TensorBoard's text plugin shows as it is (markdown: a code block)."""
    return "\n".join("    " + line for line in text.splitlines())


_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. :/]")


class MlflowTracker:
    """A run on MLflow's tracking server (MlflowClient, MLflow's client API)."""

    name = "mlflow"

    def __init__(self) -> None:
        self.client: Any = None  # MLflow's MlflowClient: imported late (the trackers extra)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        self.ready = threading.Event()  # the run exists: spans may go to it
        self.failed = threading.Event()  # its start failed: spans fail at once till it does
        self.step = 0

    @property
    def server(self) -> str | None:
        """The tracking server's URL when MLFLOW_TRACKING_URI names one (http/https)."""
        return self.uri.rstrip("/") if self.uri.startswith(("http://", "https://")) else None

    def prepare(self) -> None:
        for key, value in MLFLOW_DEFAULTS.items():
            os.environ.setdefault(key, value)
        import mlflow  # deferred: the trackers extra

        self.mlflow = mlflow

    def begin(self, run: RunStart, say: Say) -> None:
        try:
            self._begin(run)
        except BaseException:
            self.failed.set()
            raise
        self.failed.clear()
        self.ready.set()

    def _begin(self, run: RunStart) -> None:
        self.prepare()
        from mlflow.entities import Param  # deferred: the trackers extra

        self.client = self.mlflow.MlflowClient()
        self.uri = str(self.client.tracking_uri)
        self.experiment_id = self._experiment()
        tags = {
            "dflash.run.id": run.run_id,
            "dflash.output_dir": str(run.output_dir.resolve()),
            "mlflow.source.name": "dflash-train",
        }
        if run.first_step:
            tags["dflash.resumed_at_step"] = str(run.first_step)
        created = self.client.create_run(self.experiment_id, run_name=run.title, tags=tags)
        self.run_id = created.info.run_id
        params = [Param(k, v) for k, v in _params(run.config).items()]
        for chunk in _chunks(params, 100):  # MLflow takes 100 params per batch
            self.client.log_batch(self.run_id, params=chunk)
        self.client.log_dict(self.run_id, dict(run.config), "config.json")

    def _experiment(self) -> str:
        explicit = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if explicit:
            return explicit
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        kind = {"mlflow.experimentKind": "custom_model_development"}  # not a GenAI app
        try:
            return str(self.client.create_experiment(name, tags=kind))
        except Exception:  # noqa: BLE001 - made meanwhile by another run: use it
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def log_step(self, step: int, figures: Mapping[str, float]) -> None:
        from mlflow.entities import Metric  # deferred: the trackers extra

        stamp = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_KEY.sub("_", k), v, stamp, step) for k, v in figures.items()]
        for chunk in _chunks(metrics, 1000):  # MLflow takes 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=chunk)
        self.step = max(self.step, step)

    def finish(self, end: RunEnd) -> None:
        if end.summary is not None:
            self.log_step(self.step, summary_figures(end.summary))
            self.client.log_dict(self.run_id, dict(end.summary), "summary.json")
        for path in end.files:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        if end.drafter_dir is not None and end.drafter_dir.is_dir():
            self.client.log_artifacts(self.run_id, str(end.drafter_dir), "drafter")
        status = {"finished": "FINISHED", "interrupted": "KILLED"}.get(end.status, "FAILED")
        self.client.set_terminated(self.run_id, status)

    def where(self) -> str:
        if self.server and self.run_id:
            return f"{self.server}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        if self.run_id:
            return f"run {self.run_id} in {self.uri}"
        return self.server or self.uri or "MLflow's default store"

    def span_headers(self) -> dict[str, str]:
        """The headers of MLflow's OTLP endpoint: the experiment, the run, credentials."""
        headers = {"x-mlflow-experiment-id": str(self.experiment_id)}
        if self.run_id:
            headers["x-mlflow-run-id"] = self.run_id
        token = os.environ.get("MLFLOW_TRACKING_TOKEN")
        user, password = (os.environ.get(f"MLFLOW_TRACKING_{k}") for k in ("USERNAME", "PASSWORD"))
        if token:
            headers["Authorization"] = f"Bearer {token}"
        elif user and password:
            import base64

            basic = base64.b64encode(f"{user}:{password}".encode()).decode()
            headers["Authorization"] = f"Basic {basic}"
        return headers


def _params(config: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: `section.key` -> the value as config.json writes it."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_params(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _chunks(items: list[_T], size: int) -> Iterable[list[_T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class WandbTracker:
    """A W&B run (wandb's API), offline where W&B cannot be reached or no API key is set
    (WANDB_MODE, when set, decides instead)."""

    name = "wandb"
    PROBE_TIMEOUT_S = 3.0

    def __init__(self) -> None:
        self.run: Any = None  # wandb's Run: imported late (the trackers extra)
        self.mode = os.environ.get("WANDB_MODE", "").strip()
        self.step = 0

    def prepare(self) -> None:
        import wandb  # deferred: the trackers extra

        self.wandb = wandb

    def begin(self, run: RunStart, say: Say) -> None:
        self.prepare()
        wandb = self.wandb
        why_offline = None if self.mode else self._why_offline(wandb)
        if why_offline is not None:
            self.mode = "offline"
        options: dict[str, str] = {}
        if not os.environ.get("WANDB_DIR"):
            options["dir"] = str(run.output_dir)
            (run.output_dir / "wandb").mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", quiet=True, silent=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=run.title,
            config=dict(run.config),
            tags=["dflash-train"],
            mode=self.mode or "online",
            settings=settings,
            **options,
        )
        self.run.config.update({"dflash_run_id": run.run_id}, allow_val_change=True)
        if why_offline is not None:
            folder = Path(self.run.dir).parent
            say(
                f"report-to wandb: {why_offline}: offline mode, written to {folder} "
                f"(`wandb sync {folder}` uploads it)"
            )

    @classmethod
    def _why_offline(cls, wandb: Any) -> str | None:  # Any: the wandb module, imported late
        """Why the run cannot be online: no API key, or W&B's server cannot be reached
        (a TCP connection within PROBE_TIMEOUT_S). None: online."""
        base_url = os.environ.get("WANDB_BASE_URL") or str(wandb.Settings().base_url)
        host = urlparse(base_url).hostname or base_url
        if not os.environ.get("WANDB_API_KEY") and not _netrc_key(host):
            return "no W&B API key (WANDB_API_KEY or `wandb login`)"
        parsed = urlparse(base_url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((host, port), timeout=cls.PROBE_TIMEOUT_S).close()
        except OSError as exc:
            return f"no network to {base_url} ({exc.strerror or type(exc).__name__})"
        return None

    def log_step(self, step: int, figures: Mapping[str, float]) -> None:
        self.run.log(dict(figures), step=step)
        self.step = max(self.step, step)

    def finish(self, end: RunEnd) -> None:
        if end.summary is not None:
            self.run.summary.update(summary_figures(end.summary))
        self.run.finish(exit_code=0 if end.status == "finished" else 1)

    def where(self) -> str:
        if self.run is None:
            return "W&B"
        if self.mode == "offline":
            return f"{Path(self.run.dir).parent} (offline: wandb sync uploads it)"
        url = getattr(self.run, "url", None)
        return str(url) if url else str(Path(self.run.dir).parent)


def _netrc_key(host: str) -> bool:
    """Whether ~/.netrc (NETRC) holds a password for `host`, as `wandb login` writes it."""
    import netrc

    try:
        auth = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


TRACKERS: dict[str, Callable[[], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}


# ----------------------------------------------------------------- one thread per tool


@dataclass
class Delivery:
    """What became of one tool's step records (and its other items)."""

    steps: int = 0  # metrics.jsonl lines handed to it
    sent: int = 0  # of those, taken by the tool
    other_failed: int = 0  # the config, the amended last line, the summary, artifacts
    error: str | None = None  # the first failure


_STOP: tuple[str, Args] = ("stop", ())  # the end of a channel's items, told by identity


@dataclass
class _Channel:
    """One tracker on its own thread: items in order, the caller never waits."""

    tracker: Tracker
    say: Callable[[str], None]
    delivery: Delivery = field(default_factory=Delivery)
    begun: bool = False
    down_until: float = 0.0
    last_progress: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.queue: queue.Queue[tuple[str, Args]] = queue.Queue(QUEUE_ITEMS)
        self.start: RunStart | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"report-to-{self.tracker.name}", daemon=True
        )
        self.thread.start()

    def put(self, kind: str, *args: object) -> None:
        if kind == "step":
            self.delivery.steps += 1
        try:
            self.queue.put_nowait((kind, args))
        except queue.Full:
            self._not_taken(kind)

    def _not_taken(self, kind: str) -> None:
        if kind != "step":
            self.delivery.other_failed += 1

    def _run(self) -> None:
        try:
            self.tracker.prepare()
        except Exception:  # noqa: BLE001 - `begin` prepares again and tells the failure
            pass
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            kind, args = item
            self._do(kind, args)
            self.last_progress = time.monotonic()

    def _do(self, kind: str, args: Args) -> None:
        if kind == "begin":
            self.start = args[0]
        if time.monotonic() < self.down_until or self.start is None:
            self._not_taken(kind)
            return
        try:
            if not self.begun:
                self.tracker.begin(self.start, self.say)
                self.begun = True
            if kind in ("step", "amend"):
                self.tracker.log_step(*args)
                self.delivery.sent += kind == "step"
            elif kind == "finish":
                self.tracker.finish(*args)
        except Exception as exc:  # noqa: BLE001 - a tool's failure never reaches training
            self._not_taken(kind)
            self.down_until = time.monotonic() + RETRY_AFTER_S
            if self.delivery.error is None:
                self.delivery.error = _why(exc)
                self.say(
                    f"warning: report-to {self.tracker.name}: {self.tracker.where()} failed "
                    f"({self.delivery.error}); training goes on, the run's figures are in "
                    f"metrics.jsonl; not tried again for {RETRY_AFTER_S:.0f} s, what it "
                    "misses is counted at the end"
                )

    def close(self, cap_s: float) -> bool:
        """Waits while the tool makes progress (a finished item within IDLE_BOUND_S), at
        most `cap_s`; True when it took everything."""
        try:
            self.queue.put(_STOP, timeout=1.0)
        except queue.Full:
            pass
        until = time.monotonic() + cap_s
        self.last_progress = max(self.last_progress, time.monotonic())
        while self.thread.is_alive():
            now = time.monotonic()
            if now >= until or now - self.last_progress > IDLE_BOUND_S:
                break
            self.thread.join(0.1)
        left = 0
        while True:  # what is still queued at the bound was not delivered
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                left += 1
                self._not_taken(item[0])
        return not self.thread.is_alive() and left == 0


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _why(exc: BaseException) -> str:
    """A failure in a few words: the operating system's reason where a connection failed
    under the library's wrapping (`Connection refused`), else the first line."""
    seen, link = 0, exc
    reason = None
    while link is not None and seen < 12:
        if isinstance(link, OSError) and link.strerror:
            reason = link.strerror
        link, seen = link.__cause__ or link.__context__, seen + 1
    if reason is not None:
        return f"{reason}; {type(exc).__name__}"
    return f"{type(exc).__name__}: {_short(first_line(exc))}"


class Reporting:
    """The trackers of one run (rank 0; others get none). Calls return at once."""

    def __init__(
        self,
        tools: Sequence[str],
        say: Say,
        run_id: str = "",
        factories: Mapping[str, Callable[[], Tracker]] = TRACKERS,
    ) -> None:
        self.say, self.run_id = say, run_id
        self.channels = [_Channel(factories[name](), self._say) for name in wanted(tools)]
        self.logged: dict[int, dict[str, float]] = {}  # the last step's figures, as sent
        self.output_dir: Path | None = None
        self.begun_at = 0.0  # time.time() of `begin`: older files are an earlier run's
        self.closed = False

    def _say(self, line: str) -> None:
        self.say(line)

    def __bool__(self) -> bool:
        return bool(self.channels)

    def tracker(self, name: str) -> Tracker | None:
        return next((c.tracker for c in self.channels if c.tracker.name == name), None)

    def span_exporters(self) -> list[SpanExporter]:
        """Exporters for the run's spans: MLflow's OTLP endpoint, when MLFLOW_TRACKING_URI
        names a tracking server (spans wait there until the MLflow run exists)."""
        mlflow = self.tracker("mlflow")
        if isinstance(mlflow, MlflowTracker) and mlflow.server is not None:
            return [mlflow_span_exporter(mlflow)]
        return []

    def begin(
        self,
        config: Line,
        output_dir: Path,
        first_step: int = 0,
        say: Say | None = None,
    ) -> None:
        """Every check has passed: the trackers start (`say`: where their lines go from
        now on, above the progress bar)."""
        if say is not None:
            self.say = say
        self.output_dir, self.begun_at = output_dir, time.time()
        start = RunStart(config, self.run_id, output_dir, first_step)
        for channel in self.channels:
            channel.put("begin", start)

    def log_step(self, figures: Line) -> None:
        """A metrics.jsonl line, as written."""
        if not self.channels:
            return
        step = int(figures["step"])
        numbers = numeric_figures(figures)
        self.logged = {step: numbers}
        for channel in self.channels:
            channel.put("step", step, numbers)

    def log_amended(self, line: Line) -> None:
        """metrics.jsonl's last line after the final evaluation joined it: the figures the
        trackers do not have yet (a line of a step not logged before goes whole)."""
        if not self.channels or "step" not in line:
            return
        step = int(line["step"])
        before = self.logged.get(step, {})
        numbers = numeric_figures(line)
        new = {k: v for k, v in numbers.items() if k not in before or not _same(before[k], v)}
        if new:
            self.logged = {step: {**before, **new}}
            for channel in self.channels:
                channel.put("amend", step, new)

    def close(self, say: Say | None = None, cap_s: float = CLOSE_CAP_S) -> None:
        """The end of the run: the amended last line, the summary and the run's files from
        OUTPUT_DIR (what exists of them says how the run ended), then one line per tool.
        Bounded (`_Channel.close`); idempotent."""
        if self.closed or not self.channels:
            self.closed = True
            return
        self.closed = True
        if self.output_dir is None:  # refused before its checks passed: nothing begun
            for channel in self.channels:
                channel.close(0.0)
            return
        say = say or self.say
        end = self._end(self.output_dir)
        for channel in self.channels:
            channel.put("finish", end)
        until = time.monotonic() + cap_s
        for channel in self.channels:
            channel.close(max(0.0, until - time.monotonic()))
            say(self._line(channel))

    def _end(self, folder: Path) -> RunEnd:
        last = _last_line(folder / "metrics.jsonl", self.begun_at)
        if last is not None:
            self.log_amended(last)
        summary = _last_line(folder / "summary.json", self.begun_at, whole=True)
        if not isinstance(summary, dict):
            return RunEnd("failed", files=(folder / "metrics.jsonl",))
        status = "interrupted" if summary.get("interrupted") else "finished"
        drafter = summary.get("drafter_dir")
        files = tuple(folder / n for n in ("metrics.jsonl", "report.html", "config.json"))
        return RunEnd(status, summary, Path(drafter) if drafter else None, files)

    @staticmethod
    def _line(channel: _Channel) -> str:
        """The tool's closing line: what it took; a failure already told is not told
        again (its one warning line came at the first failure)."""
        tool, d = channel.tracker, channel.delivery
        where = tool.where()
        if d.sent == d.steps and not d.other_failed and channel.begun:
            return f"report-to {tool.name}: {d.sent} steps to {where}"
        counted = f"{d.sent} of {d.steps} steps delivered to {where}"
        if d.error is not None:
            return f"report-to {tool.name}: {counted}; the others are only in metrics.jsonl"
        return (
            f"warning: report-to {tool.name}: {counted} (no answer within the bound); the "
            "run's figures are all in metrics.jsonl"
        )


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _last_line(path: Path, since: float, whole: bool = False) -> JSON | None:
    """The JSON object of a file's last line (`whole`: of the whole file) when this run
    wrote the file (modified at or after `since`), else None."""
    try:
        if path.stat().st_mtime < since - 1.0:  # 1 s: file times of coarse file systems
            return None
        text = path.read_text(encoding="utf-8")
        lines = [text] if whole else text.splitlines()
        last = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return last if isinstance(last, dict) else None


def start_reporting(
    report_to: Sequence[str], run_id: str, say: Say, is_main: bool = True
) -> Reporting:
    """The run's trackers (none on ranks other than 0): their threads, nothing sent yet.
    A tool whose library is missing is one TrackerError (`check_installed`)."""
    if not is_main:
        return Reporting((), say)
    check_installed(report_to)
    return Reporting(report_to, say, run_id)


# ----------------------------------------------------------------- spans to MLflow


def mlflow_span_exporter(tracker: MlflowTracker) -> SpanExporter:
    """A span exporter to the MLflow tracking server's OTLP endpoint (/v1/traces,
    OTLP/HTTP protobuf) with the experiment and run of `tracker` in its headers: the
    spans are MLflow traces of the run. Until the run exists (its checks pass, its
    start on the tracker's thread) an export waits; once the tracker has failed, it
    fails at once (tracing counts it)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class MlflowSpanExporter(SpanExporter):
        def __init__(self) -> None:
            self.closed = threading.Event()
            self.inner: OTLPSpanExporter | None = None

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            while not tracker.ready.is_set():
                if tracker.failed.is_set() or self.closed.wait(SPAN_WAIT_S):
                    return SpanExportResult.FAILURE
            if self.closed.is_set():
                return SpanExportResult.FAILURE
            if self.inner is None:
                self.inner = OTLPSpanExporter(
                    endpoint=f"{tracker.server}/v1/traces",
                    headers=tracker.span_headers(),
                    timeout=10,
                )
            return self.inner.export(spans)

        def shutdown(self) -> None:
            self.closed.set()
            if self.inner is not None:
                self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return MlflowSpanExporter()
