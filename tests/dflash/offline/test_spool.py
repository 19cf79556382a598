"""The spool's protocol (dflash.offline.spool), its two sides against each other: the
writer's functions of tools/vllm/extract_hidden_states.py (loaded from its file: it runs
in vLLM's venv and never imports dflash) and the reader the training run uses. vLLM
itself is replaced by what its connector writes, a raw file per request; the real engine
runs in tests/integration/test_vllm_streamed.py."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from safetensors.torch import save_file

import tracing
from dflash import names
from dflash.config.checks import parse_size
from dflash.offline.sample_file import SampleFile
from dflash.offline.spool import (
    RAW_DIR,
    EngineDied,
    Spool,
    SpoolError,
    sample_bytes,
    sample_path,
    spool_bytes,
)
from dflash.run.streamed import engine_span

REPO = Path(__file__).resolve().parents[3]
WIDTH, ITEMSIZE = 16, 4


def _writer() -> ModuleType:
    path = REPO / "tools" / "vllm" / "extract_hidden_states.py"
    spec = importlib.util.spec_from_file_location("extract_hidden_states", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _samples(count: int) -> list[tuple[int, list[int], list[bool]]]:
    return [(n, list(range(5 + n % 7)), [n % 2 == 0] * (5 + n % 7)) for n in range(count)]


def test_sizes_are_the_same_on_both_sides_and_bound_a_real_file(tmp_path: Path) -> None:
    writer = _writer()
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 500 * 10**6
    assert parse_size("1048576") == 2**20
    with pytest.raises(ValueError, match="not a size"):
        parse_size("2 gigs")
    for t, layers in ((1, 2), (7, 3), (512, 7)):
        assert writer.spool_sample_bytes(t, layers, WIDTH, 2) == sample_bytes(t, layers, WIDTH, 2)
    # A converted file, as the writer makes it, within the size both sides count.
    (n, ids, mask) = _samples(3)[2]
    raw = tmp_path / "raw.safetensors"
    save_file(
        {"hidden_states": torch.randn(len(ids), 3, WIDTH), "token_ids": torch.tensor(ids)}, raw
    )
    out = sample_path(tmp_path, n)
    out.parent.mkdir()
    writer.convert(raw, out, (n, ids, mask), [1, 0, 2], torch.float32, WIDTH)
    assert out.stat().st_size <= sample_bytes(len(ids), 3, WIDTH, ITEMSIZE)
    assert raw.stat().st_size <= writer.spool_sample_bytes(len(ids), 3, WIDTH, ITEMSIZE)
    assert SampleFile(out, WIDTH).layers == 3


def test_the_writer_waits_for_the_reader_and_the_spool_stays_within_its_bound(
    tmp_path: Path,
) -> None:
    writer = _writer()
    samples = _samples(120)
    largest = max(sample_bytes(len(ids), 3, WIDTH, ITEMSIZE) for _, ids, _ in samples)
    bound = 4 * largest
    spool = Spool(tmp_path / "spool")
    peak, stop = [0], threading.Event()

    def watch() -> None:  # the spool's bytes, seen from outside both sides
        while not stop.is_set():
            peak[0] = max(peak[0], spool_bytes(spool.directory))

    def write() -> None:  # as extract() does with vLLM's raw files
        raw_dir = spool.directory / RAW_DIR
        raw_dir.mkdir(exist_ok=True)
        for part, need in writer.spool_parts(samples, bound, 3, 3, WIDTH, ITEMSIZE, 256):
            writer.spool_wait(spool.directory, need, bound, poll_s=0.001)
            raws = []
            for n, ids, _ in part:
                states = torch.full((len(ids), 3, WIDTH), float(n))
                raws.append(raw_dir / f"r{n}.safetensors")
                save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, raws[-1])
            for sample, raw in zip(part, raws, strict=True):
                out = sample_path(spool.directory, sample[0])
                writer.convert(raw, out, sample, [0, 1, 2], torch.float32, WIDTH)
                raw.unlink()

    threads = [threading.Thread(target=watch), threading.Thread(target=write)]
    for thread in threads:
        thread.start()
    total = 0
    try:
        for n, ids, _ in samples:
            path = spool.wait(n, lambda: None, poll_s=0.001)
            sample = SampleFile(path, WIDTH)
            (hs,) = sample.read("hidden_states")
            assert sample.length == len(ids) and bool((hs == n).all()), n  # in order, whole
            total += path.stat().st_size
            spool.remove(path)
            time.sleep(0.002)  # a reader slower than the writer: the writer must wait
    finally:
        threads[1].join(30)
        stop.set()
        threads[0].join()
    assert total >= 10 * bound, (total, bound)
    assert 0 < peak[0] <= bound and spool.peak_bytes <= bound, (peak[0], spool.peak_bytes, bound)
    assert spool_bytes(spool.directory) == 0


def test_one_run_per_spool_and_a_dead_engine_is_one_error(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    with pytest.raises(SpoolError, match="in use by another run"):
        Spool(tmp_path / "spool")
    with pytest.raises(EngineDied, match="exited with code 1"):
        spool.wait(0, lambda: "the vLLM engine exited with code 1: see its log")
    spool.close()
    Spool(tmp_path / "spool").close()  # free again
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SpoolError, match="is not writable"):
        Spool(blocker / "spool")


def test_the_ranks_of_one_run_share_a_spool_and_a_second_run_is_refused(
    tmp_path: Path,
) -> None:
    # torchrun's ranks each take a folder of their own under the spool, and the spool
    # itself shared: a second run is refused whether it runs on ranks or alone.
    where = tmp_path / "spool"
    ranks = [Spool(where, rank=r) for r in range(2)]
    assert [s.directory for s in ranks] == [where / "rank-00000", where / "rank-00001"]
    with pytest.raises(SpoolError, match=r"rank-00001 is in use by another run"):
        Spool(where, rank=1)
    with pytest.raises(SpoolError, match=r"spool is in use by another run"):
        Spool(where)
    for spool in ranks:
        spool.close()
    alone = Spool(where)
    with pytest.raises(SpoolError, match=r"spool is in use by another run"):
        Spool(where, rank=0)
    alone.close()
    # A rank's folder is emptied of an earlier run's samples, the others' left alone.
    stale = sample_path(where / "rank-00001", 0)
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"x")
    Spool(where, rank=0).close()
    assert stale.exists()
    Spool(where, rank=1).close()
    assert not stale.exists()


def test_a_sample_too_big_for_the_bound_is_refused_by_the_writer() -> None:
    writer = _writer()
    with pytest.raises(writer.UsageError, match="--spool-size 100 bytes"):
        list(writer.spool_parts(_samples(2), 100, 3, 3, WIDTH, ITEMSIZE, 256))


def test_the_engines_times_become_a_span_under_the_reading_phase(tmp_path: Path) -> None:
    # The writer records the sample's vLLM call in the file; the reader's phase gets the
    # engine's span, from the call to the file's write, with an event when vLLM was done.
    writer = _writer()
    (n, ids, mask) = _samples(4)[3]
    raw = tmp_path / "raw.safetensors"
    save_file(
        {"hidden_states": torch.randn(len(ids), 3, WIDTH), "token_ids": torch.tensor(ids)}, raw
    )
    out = sample_path(tmp_path, n)
    out.parent.mkdir()
    queued = time.time_ns() - 2_000_000_000
    times = {"queued_ns": queued, "extracted_ns": queued + 1_500_000_000}
    writer.convert(raw, out, (n, ids, mask), [1, 0, 2], torch.float32, WIDTH, times)
    assert out.stat().st_size <= sample_bytes(len(ids), 3, WIDTH, ITEMSIZE)  # with its times
    exporter = InMemorySpanExporter()
    tracing.setup(tracing.TracingConfig(), span_processors=[SimpleSpanProcessor(exporter)])
    try:
        with tracing.phase(names.TARGET_READ, level="step"):
            engine_span(SampleFile(out, WIDTH), n)
        engine_span(SampleFile(out, WIDTH), n)  # no phase open: no span, no stray trace
    finally:
        tracing.shutdown(timeout_s=1.0)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == [names.ENGINE_SAMPLE, names.TARGET_READ], sorted(spans)
    engine, reading = spans[names.ENGINE_SAMPLE], spans[names.TARGET_READ]
    assert engine.parent is not None and engine.parent.span_id == reading.context.span_id
    assert engine.context.trace_id == reading.context.trace_id
    assert engine.start_time == queued and engine.end_time == out.stat().st_mtime_ns
    assert [(e.name, e.timestamp) for e in engine.events] == [("extracted", queued + 1_500_000_000)]
    assert engine.attributes[names.SAMPLE_INDEX] == n


def test_a_sample_without_the_engines_times_has_no_span(tmp_path: Path) -> None:
    (n, ids, _) = _samples(1)[0]
    out = sample_path(tmp_path, n)
    out.parent.mkdir()
    tensors = {"hidden_states": torch.randn(len(ids), 3, WIDTH), "token_ids": torch.tensor(ids)}
    save_file(tensors, out)  # a file of another writer: no metadata
    exporter = InMemorySpanExporter()
    tracing.setup(tracing.TracingConfig(), span_processors=[SimpleSpanProcessor(exporter)])
    try:
        with tracing.phase(names.TARGET_READ, level="step"):
            engine_span(SampleFile(out, WIDTH), n)
    finally:
        tracing.shutdown(timeout_s=1.0)
    assert [s.name for s in exporter.get_finished_spans()] == [names.TARGET_READ]


def test_the_writers_error_line_keeps_the_reason_of_a_validation_error() -> None:
    # vLLM refuses a target it cannot load with pydantic's error, whose first line only
    # counts the errors; the reason is below, before a list of every architecture.
    from pydantic import BaseModel, field_validator

    class ModelConfig(BaseModel):
        model: str

        @field_validator("model")
        @classmethod
        def known(cls, value: str) -> str:
            supported = ", ".join(f"'Arch{i}ForCausalLM'" for i in range(300))
            raise ValueError(
                f"Model architectures ['NoSuchLM'] are not supported for now. "
                f"Supported architectures: dict_keys([{supported}])"
            )

    writer = _writer()
    with pytest.raises(ValueError) as refused:
        ModelConfig(model="t")
    line = writer.one_line(refused.value)
    assert line.startswith("1 validation error for ModelConfig: Value error, Model "), line
    assert "['NoSuchLM'] are not supported" in line and len(line) <= 300, line
    assert writer.one_line(OSError(28, "No space left on device")) == (
        "[Errno 28] No space left on device"
    )
