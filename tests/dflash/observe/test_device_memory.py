"""Device memory without a GPU: a fake allocator (`MemorySource`, the shape of
torch.cuda.memory_stats) behind the interval table's figure and the metrics. Nothing
resets the program's peak; the peak is dflash's own running maximum, so it means the
same on every rank. And the start-up line of a CUDA run traced with device timing off."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from test_run_metrics import Captured

import tracing
from dflash.observe.instruments import PeakMemory
from dflash.observe.metrics import NAMESPACE, start_run_metrics
from dflash.observe.observer import cuda_timing_note

GIB = 2**30


class FakeAllocator:
    """Per-device allocator figures the test sets; `reset_peak` is what a program's own
    `torch.cuda.reset_peak_memory_stats` does to them."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, int]] = {}
        self.reads = 0

    def set(self, device: str, allocated: float, reserved: float, peak: float) -> None:
        self.stats[device] = {
            "allocated_bytes.all.current": int(allocated * GIB),
            "reserved_bytes.all.current": int(reserved * GIB),
            "allocated_bytes.all.peak": int(peak * GIB),
        }

    def reset_peak(self, device: str) -> None:
        stats = self.stats[device]
        stats["allocated_bytes.all.peak"] = stats["allocated_bytes.all.current"]

    def memory_stats(self, device: str) -> Mapping[str, int]:
        self.reads += 1
        return dict(self.stats[device])


def test_the_table_shows_allocated_reserved_and_the_run_peak_without_resetting_it() -> None:
    source = FakeAllocator()
    source.set("cuda:0", allocated=1.0, reserved=1.5, peak=3.0)
    source.set("cuda:1", allocated=2.0, reserved=2.5, peak=2.0)
    memory = PeakMemory(["cuda:0", torch.device("cuda:1"), "cuda:0"], source=source)
    assert [m.device for m in memory.devices] == ["cuda:0", "cuda:1"]  # one per device
    assert memory.table_gib() == "cuda:0 1.00/1.50/3.00 cuda:1 2.00/2.50/2.00"
    # Reading reset nothing: torch's peak is as the program left it.
    assert source.stats["cuda:0"]["allocated_bytes.all.peak"] == 3 * GIB
    assert memory.table_gib() == "cuda:0 1.00/1.50/3.00 cuda:1 2.00/2.50/2.00"


def test_the_peak_is_a_running_maximum_a_programs_reset_does_not_lower() -> None:
    source = FakeAllocator()
    source.set("cuda:0", allocated=1.0, reserved=2.0, peak=4.0)
    memory = PeakMemory(["cuda:0"], source=source)
    (device,) = memory.devices
    assert device.read().peak == 4 * GIB
    source.reset_peak("cuda:0")  # the program's own reset between two reads
    source.set("cuda:0", allocated=1.5, reserved=2.0, peak=1.5)
    reading = device.read()
    assert (reading.allocated, reading.reserved, reading.peak) == (1.5 * GIB, 2 * GIB, 4 * GIB)
    # A new high after the reset raises it.
    source.set("cuda:0", allocated=1.0, reserved=6.0, peak=5.0)
    assert device.read().peak == 5 * GIB


def test_the_gauges_carry_the_device_and_mean_the_same_wherever_they_are_read() -> None:
    source = FakeAllocator()
    source.set("cuda:0", allocated=1.0, reserved=1.5, peak=3.0)
    memory = PeakMemory(["cuda:0"], source=source)
    captured = Captured()
    cfg = tracing.TracingConfig(run_id="r", attribute_namespace=NAMESPACE)
    metrics = start_run_metrics(
        cfg,
        tracing.ProfileStats(),
        tokens={},
        steps={},
        queues={},
        memory=memory.metric_readers(),
        exporters=[captured],
        export_interval_s=3600,
    )
    try:
        memory.table_gib()  # rank 0's table reads too: the metrics mean the same after it
        source.set("cuda:0", allocated=0.5, reserved=1.5, peak=0.5)  # reset in between
        assert metrics.force_flush()
        points = captured.points()
    finally:
        metrics.shutdown()
    assert points["dflash.device.memory.allocated"] == {"cuda:0": 0.5 * GIB}
    assert points["dflash.device.memory.reserved"] == {"cuda:0": 1.5 * GIB}
    assert points["dflash.device.memory.peak"] == {"cuda:0": 3 * GIB}


def test_cpu_devices_have_no_memory_figures() -> None:
    assert not PeakMemory(["cpu", torch.device("cpu")]).enabled


@pytest.mark.parametrize(
    ("level", "timing", "devices", "noted"),
    [
        ("step", "off", ["cuda"], True),
        ("phase", "off", ["cpu", "cuda"], True),
        ("off", "off", ["cuda"], False),  # no spans to misread
        ("phase", "events", ["cuda"], False),
        ("phase", "sync", ["cuda"], False),
        ("phase", "off", ["cpu"], False),  # a CPU run: its spans are its work
        ("phase", "off", [], False),
    ],
)
def test_the_cuda_timing_note_is_for_traced_cuda_runs_timed_off(
    level: str, timing: str, devices: list[str], noted: bool
) -> None:
    note = cuda_timing_note(level, timing, devices)
    assert (note is not None) == noted
    if note is not None:
        assert note.startswith("warning: --cuda-timing off")  # a WARNING record (dflash.log)
        assert "kernel launches" in note and "--cuda-timing events" in note
