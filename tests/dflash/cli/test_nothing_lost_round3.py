"""Issue 41 ("Nothing lost, round 3"): a command replaces only the files it wrote, a write
that fails is one line and a non-zero exit, a server or a file that never answers is
bounded, and an unknown DFLASH_* variable is told. Every case: one `Error:` line (or one
warning), no traceback, in bounded time."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dflash import cli as cli_mod
from dflash.cli.options import check_output, unknown_variables, write_json
from dflash.files import record_path, write_output
from dflash.offline import hidden_cache
from dflash.offline.hidden_cache import HiddenCacheError, write_hidden_cache
from dflash.target.served import CompletionClient, ServerError, ServerSettings
from tests.dflash.app_fixtures import tiny_target, write_corpus  # noqa: F401 - fixture
from tests.dflash.cli.test_output_checks import invoke, refused, train_args
from tests.dflash.offline.test_hidden_cache import _data, _target
from tests.dflash.run.test_outputs import make_run
from tracing.export import OtlpJsonFileExporter, trace_file_errors


def full_device(tmp_path: Path) -> Path:
    """A device whose every write fails with ENOSPC: a private twin of /dev/full where
    this process may make one (so that no test can ever replace the system's), else
    /dev/full itself (where no file can replace it either)."""
    twin = tmp_path / "full"
    try:
        os.mknod(twin, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except OSError:
        return Path("/dev/full")
    return twin


def bounded(call: Callable[[], Any], fifo: Path, within_s: float = 10.0) -> Any:
    """`call()`, which must end by itself within `within_s`; when it hangs on `fifo`
    instead, a writer is opened to release it and the test fails."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    if thread.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(5)
        pytest.fail(f"still reading {fifo} after {within_s} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


# --------------------------------------------------------------------------- 2. whose file


def test_eval_and_inspect_data_json_never_replace_a_users_file(tmp_path) -> None:
    drafter = make_run(tmp_path / "done") / "drafter"
    mine = tmp_path / "mine.json"
    mine.write_text('{"mine": 1}\n')
    line = refused(invoke(["eval", "--drafter", drafter, "--json", mine]))
    assert "was not written by dflash-train eval" in line and "--overwrite" in line
    corpus = write_corpus(tmp_path)
    line = refused(invoke(["inspect-data", "--data", corpus, "--json", mine, "--rows", "0"]))
    assert "was not written by dflash-train inspect-data" in line
    assert mine.read_text() == '{"mine": 1}\n' and not record_path(mine).exists()


def test_inspect_data_replaces_its_own_json_and_with_overwrite_any(tmp_path) -> None:
    corpus, out = write_corpus(tmp_path), tmp_path / "docs.json"
    args = ["inspect-data", "--data", corpus, "--rows", "0", "--json", out]
    for _ in range(2):  # the second run replaces what the first wrote
        result = invoke(args)
        assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())[0]["tokens"]
    out.write_text("[]\n")  # changed since: not the command's any more
    assert "or changed since" in refused(invoke(args))
    assert invoke([*args, "--overwrite"]).exit_code == 0
    assert json.loads(out.read_text()) != []


def test_eval_replaces_the_figures_it_wrote_before(tmp_path) -> None:
    out = tmp_path / "e.json"
    write_json(str(out), {"tau": 3.5})
    check_output(str(out), "--json", command="eval")  # its own: passes
    with pytest.raises(Exception, match="was not written by dflash-train inspect-data"):
        check_output(str(out), "--json", command="inspect-data")
    check_output(str(out), "--json", command="inspect-data", overwrite=True)


def test_inspect_data_json_onto_a_full_device_is_one_line_and_nothing_replaced(tmp_path) -> None:
    device = full_device(tmp_path)
    corpus = write_corpus(tmp_path)
    result = invoke(["inspect-data", "--data", corpus, "--rows", "0", "--json", device])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: --json: could not write {device} (No space left on device)"]
    assert f"documents in {device}" not in result.output
    assert stat.S_ISCHR(os.stat(device).st_mode)  # still the device, never replaced


def test_devices_are_written_in_place_and_a_fifo_without_reader_is_refused(tmp_path) -> None:
    write_output("/dev/null", "{}\n", "eval")  # no record beside a device
    assert not Path("/dev/null.run.json").exists()
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as failed:
        write_output(fifo, "{}\n", "eval")  # no reader: at once, not a hang
    assert failed.value.errno == errno.ENXIO
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_trace_file_that_fails_is_told_once_without_a_traceback(tmp_path, caplog) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

    device = str(full_device(tmp_path))
    told: list[str] = []
    exporter = OtlpJsonFileExporter(device, told.append)
    spans: list[Any] = []

    class Keep(SimpleSpanProcessor):
        def on_end(self, span: Any) -> None:
            spans.append(span)

    provider = TracerProvider()
    provider.add_span_processor(Keep(exporter))
    provider.get_tracer("t").start_span("x").end()
    assert exporter.export(spans) == SpanExportResult.FAILURE
    assert exporter.export(spans) == SpanExportResult.FAILURE
    exporter.shutdown()
    assert told == [
        f"trace file {device}: could not write (No space left on device): spans are lost"
    ]
    assert trace_file_errors()[device] == "No space left on device"
    assert "Traceback" not in caplog.text


@pytest.mark.usefixtures("tiny_target")
def test_train_with_a_trace_file_that_fails_ends_with_one_line_and_exit_2(tmp_path) -> None:
    device = full_device(tmp_path)
    args = train_args(tmp_path, tmp_path / "run", "--trace-file", device)
    result = CliRunner().invoke(cli_mod.cli, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"--trace-file {str(device)!r}: could not write" in errors[0]
    assert (tmp_path / "run" / "drafter").is_dir()  # the run itself is complete


def test_cache_hidden_on_a_full_disk_is_the_line_train_gives(tmp_path, monkeypatch) -> None:
    target, data = _target(), _data(tmp_path)
    shards = {"layer_ids": [1, 2], "batches_per_shard": 2}
    calls = {"n": 0}
    save = hidden_cache.save_file

    def filling(tensors: Any, path: str) -> None:
        calls["n"] += 1
        if calls["n"] > 1:  # the disk is full from the second shard on
            raise OSError(errno.ENOSPC, "No space left on device")
        save(tensors, path)

    monkeypatch.setattr(hidden_cache, "save_file", filling)
    with pytest.raises(HiddenCacheError) as failed:
        write_hidden_cache(target, data, tmp_path / "cache", num_batches=5, **shards)
    line = str(failed.value)
    assert line.startswith(f"could not write {tmp_path / 'cache' / 'shard-00001.safetensors'}")
    assert "No space left on device; " in line and "first 2 of 5 batches are complete" in line
    monkeypatch.setattr(hidden_cache, "save_file", save)  # room again: the same call continues
    write_hidden_cache(target, data, tmp_path / "cache", num_batches=5, **shards)


# --------------------------------------------------------------------------- 5. bounded


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A socket on loopback that takes connections (the kernel's backlog), never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_the_probe_of_a_silent_server_ends_within_its_deadline(silent_server) -> None:
    waits: list[float] = []
    client = CompletionClient(ServerSettings(silent_server), sleep=waits.append)  # 600 s, 5 retries
    started = time.monotonic()
    with pytest.raises(ServerError, match="no answer within 3 s"):
        client.served_models()
    assert time.monotonic() - started < 6 and waits == []


def test_a_refused_connection_is_one_line_at_once() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    waits: list[float] = []
    client = CompletionClient(ServerSettings(f"http://127.0.0.1:{port}"), sleep=waits.append)
    for call in (client.served_models, client.metrics_text):  # the probe, and later requests
        with pytest.raises(ServerError, match="connection refused: nothing listens there"):
            call()
    assert waits == []


def test_eval_at_a_silent_server_is_one_line_in_seconds(silent_server) -> None:
    started = time.monotonic()
    result = invoke(["eval", "--server", silent_server, "--target", "builtin:tiny"])
    line = refused(result)
    assert "no answer within 3 s" in line and time.monotonic() - started < 15


def test_a_config_that_is_a_fifo_is_refused_unread(tmp_path) -> None:
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    result = bounded(lambda: invoke(["train", "--config", fifo]), fifo)
    assert refused(result) == f"Error: --config {str(fifo)!r}: a FIFO, not a regular file"


def test_report_on_a_run_whose_metrics_are_a_fifo_is_refused_unread(tmp_path) -> None:
    run = make_run(tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    result = bounded(lambda: invoke(["report", run]), run / "metrics.jsonl")
    assert "metrics.jsonl is a FIFO, not a regular file" in refused(result)


# --------------------------------------------------------------------------- 7. told


def test_an_unknown_dflash_variable_is_one_warning_naming_the_nearest() -> None:
    known = ["DFLASH_STEPS", "DFLASH_LR"]
    env = {
        "DFLASH_STPES": "5",
        "DFLASH_STEPS": "5",
        "DFLASH_CACHE_DIR": "/c",
        "DFLASH_VENV": "/v",
        "DFLASH_REQUIRE_JAEGER": "1",
        "DFLASH_JAEGER_BIN": "/j",
        "DFLASH_ZZZ": "1",
        "HOME": "/root",
    }
    lines = unknown_variables(env, known)
    assert lines == [
        "warning: DFLASH_STPES is not a dflash-train variable and is ignored (did you mean "
        "DFLASH_STEPS?)",
        "warning: DFLASH_ZZZ is not a dflash-train variable and is ignored "
        "(`dflash-train COMMAND --help` lists them)",
    ]


def test_every_command_warns_of_a_misspelt_variable_and_knows_every_option() -> None:
    result = invoke(["report", "/no/such/run"], env={"DFLASH_STPES": "5"})
    assert result.exit_code == 2
    assert result.output.splitlines()[0] == (
        "warning: DFLASH_STPES is not a dflash-train variable and is ignored (did you mean "
        "DFLASH_STEPS?)"
    )
    env = {"DFLASH_MAX_NEW_TOKENS": "4", "DFLASH_OUTPUT": "x", "DFLASH_SERVER": "http://a"}
    result = invoke(["report", "/no/such/run"], env=env)  # options of other commands
    assert "warning" not in result.output
