"""What a run records besides spans and tables: the Perfetto timeline, NVTX ranges, the
torch.profiler window, device memory (never resetting torch's peak), and the model
FLOPs behind TFLOP/s and MFU.

`build_instruments` constructs them from cfg.telemetry before any training, so a path
that cannot be written is one line (ObserveError) before work starts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dflash.config.devices import native_bf16
from dflash.config.settings import TelemetryConfig
from dflash.errors import DFlashError
from dflash.log import Log
from dflash.observe.flops import cpu_matmul_peak_gflops, device_peak_tflops
from dflash.observe.profile_window import ProfileWindow
from dflash.observe.timeline import Timeline
from tracing import Phase, SpanHandle

TIMELINE_OFF = "off"
DEFAULT_TIMELINE = "timeline.json"
# The default timeline keeps the run's first events: enough batches for report.html,
# and a bounded file for long runs (an explicit --timeline keeps the library's bound).
DEFAULT_TIMELINE_EVENTS = 100_000
TIMELINE_SAMPLE_S = 0.5
PROFILE_DIR = "profile"


class ObserveError(DFlashError):
    """A telemetry setting that tracing rejects (one line naming the flag)."""


class _LineHandler(logging.Handler):
    """Hands the library's one-line notes to the run's log."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        self._log(record.getMessage())


class MainThreadPhase:
    """The innermost phase the main thread is in, traced or not: a signal's one-line
    message names it ("stopped by SIGTERM during data.prepare"). A phase hook; other
    threads' phases cost it one comparison."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._main = threading.main_thread().ident

    def phase_started(self, phase: Phase) -> None:
        if threading.get_ident() == self._main:
            self._names.append(phase.name)

    def phase_ended(self, phase: Phase, exc: BaseException | None) -> None:
        if threading.get_ident() == self._main and self._names:
            self._names.pop()

    def span_started(self, handle: SpanHandle) -> None:
        pass

    def span_ended(self, handle: SpanHandle, end_time_ns: int) -> None:
        pass

    def current(self) -> str | None:
        names = self._names
        return names[-1] if names else None


MAIN_THREAD_PHASE = MainThreadPhase()


@dataclass
class Instruments:
    timeline: Timeline | None = None
    profile: ProfileWindow | None = None
    nvtx: NvtxRanges | None = None

    @property
    def hooks(self) -> list[object]:
        """The phase hooks `tracing.setup` installs."""
        return [h for h in (self.timeline, self.nvtx, MAIN_THREAD_PHASE) if h is not None]

    def close(self, write: bool = True) -> dict[str, str]:
        """Writes the timeline (unless not `write`) and stops the profiler (idempotent);
        the files written."""
        files = {}
        if self.timeline is not None and (path := self.timeline.close(write)) is not None:
            files["timeline"] = str(path)
        if self.profile is not None and (path := self.profile.close()) is not None:
            files["profile"] = str(path)
        return files


def timeline_file(tel: TelemetryConfig, output_dir: Path) -> tuple[Path | None, int | None]:
    """(path, max events) of the timeline cfg.telemetry asks for; (None, None) when off."""
    if tel.timeline == TIMELINE_OFF:
        return None, None
    if tel.timeline is None:
        return output_dir / DEFAULT_TIMELINE, DEFAULT_TIMELINE_EVENTS
    return Path(tel.timeline), None


def build_instruments(tel: TelemetryConfig, output_dir: Path, rank: int, log: Log) -> Instruments:
    """Timeline, profiler window and NVTX hook of cfg.telemetry (`tel`) for `rank`."""
    out = Instruments()
    path, max_events = timeline_file(tel, output_dir)
    try:
        if path is not None:
            if max_events is None:
                out.timeline = Timeline(path, rank=rank)
            else:
                out.timeline = Timeline(path, rank=rank, max_events=max_events)
    except ValueError as exc:
        raise ObserveError(f"--timeline {str(path)!r} is invalid: {exc}") from None
    try:
        if tel.torch_profile is not None:
            out.profile = ProfileWindow(tel.torch_profile, output_dir / PROFILE_DIR, rank=rank)
    except ValueError as exc:
        raise ObserveError(f"--torch-profile {tel.torch_profile!r} is invalid: {exc}") from None
    if tel.nvtx:
        note = logging.Logger("dflash.nvtx")
        note.addHandler(_LineHandler(log if rank == 0 else (lambda _: None)))
        out.nvtx = nvtx_ranges(note)
    return out


@dataclass(frozen=True)
class FlopsFigures:
    """Model FLOPs per trained token of each stage, and the devices' peaks."""

    target_per_token: float
    drafter_per_token: float
    """Training FLOPs of one drafter step over the tokens of its batch."""
    target_peak_tflops: float | None = None
    """Sum over the target devices; None where a device's peak is unknown (CPUs)."""
    drafter_peak_tflops: float | None = None
    target_cpu_peaks: dict[str, float] | None = None
    """A stage on the CPU: its measured matmul GFLOP/s by dtype name (fp32, and bf16
    where the CPU has it natively), shared by every thread of the stage."""
    drafter_cpu_peaks: dict[str, float] | None = None


def _total_peak(devices: Sequence[torch.device]) -> float | None:
    peaks = [device_peak_tflops(d) for d in devices]
    # (mypy ignore below) no None left: checked just before
    return None if not peaks or any(p is None for p in peaks) else float(sum(peaks))  # type: ignore[arg-type]


def _cpu_peaks(devices: Sequence[torch.device]) -> dict[str, float] | None:
    """The CPU's measured matmul peaks when a stage runs on it alone (measured once)."""
    if not devices or any(torch.device(d).type != "cpu" for d in devices):
        return None
    peaks = {"fp32": cpu_matmul_peak_gflops(torch.float32)}
    if native_bf16(torch.device("cpu")):  # emulated bf16 would take seconds to say little
        peaks["bf16"] = cpu_matmul_peak_gflops(torch.bfloat16)
    return peaks


def flops_figures(
    target_per_token: float,
    drafter_per_token: float,
    target_devices: Sequence[torch.device],
    drafter_devices: Sequence[torch.device],
) -> FlopsFigures:
    """The figures, with the peaks of the stages' devices (the caller counts the FLOPs of
    its models with dflash.observe.flops: this layer knows no model)."""
    return FlopsFigures(
        target_per_token=target_per_token,
        drafter_per_token=drafter_per_token,
        target_peak_tflops=_total_peak(target_devices),
        drafter_peak_tflops=_total_peak(drafter_devices),
        target_cpu_peaks=_cpu_peaks(target_devices) if target_per_token else None,
        drafter_cpu_peaks=_cpu_peaks(drafter_devices),
    )


class MemorySource(Protocol):
    """Where a device's memory figures come from: `torch.cuda.memory_stats`'s keys
    (`allocated_bytes.all.current`, `allocated_bytes.all.peak`,
    `reserved_bytes.all.current`); a fake in tests."""

    def memory_stats(self, device: str) -> Mapping[str, int]: ...


class CudaMemory:
    """torch.cuda's allocator statistics: read, never reset."""

    def memory_stats(self, device: str) -> Mapping[str, int]:
        return torch.cuda.memory_stats(torch.device(device))


@dataclass(frozen=True)
class MemoryReading:
    """Bytes on one device: allocated and reserved (the caching allocator's) now, and
    the most allocated at once in the run so far."""

    allocated: int
    reserved: int
    peak: int


class DeviceMemory:
    """One device's memory figures. The peak is dflash's own running maximum of torch's
    (`allocated_bytes.all.peak`) and of the allocation now: the run never resets torch's
    peak (`torch.cuda.max_memory_allocated` stays the program's own), and a reset there
    lowers torch's figure, never this one. Read by the reporter and the metrics threads."""

    def __init__(self, device: str, source: MemorySource) -> None:
        self.device, self._source = device, source
        self._peak = 0
        self._lock = threading.Lock()

    def read(self) -> MemoryReading:
        stats = self._source.memory_stats(self.device)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        with self._lock:
            peak = max(self._peak, int(stats.get("allocated_bytes.all.peak", 0)), allocated)
            self._peak = peak
        return MemoryReading(allocated, reserved, peak)


class PeakMemory:
    """The memory figures of the run's CUDA devices, the same on every rank: per device
    (labelled with it) the bytes allocated and reserved now and the run's peak so far
    (`DeviceMemory`). `table_gib()` for the interval tables, `metric_readers()` for the
    metrics; neither resets anything. `source`: torch.cuda unless given (a fake in tests)."""

    TABLE_LABEL = "memory GiB alloc/reserved/peak"

    def __init__(
        self, devices: Sequence[torch.device | str | int] = (), source: MemorySource | None = None
    ) -> None:
        if source is None:
            cuda = torch.cuda.is_available()
            devices = [d for d in devices if cuda and torch.device(d).type == "cuda"]
            source = CudaMemory()
        names = dict.fromkeys(str(torch.device(d)) for d in devices)  # one per device
        self.devices = [DeviceMemory(name, source) for name in names]

    @property
    def enabled(self) -> bool:
        return bool(self.devices)

    def table_gib(self) -> str:
        """`cuda:0 1.20/1.50/2.10 cuda:1 ...`: allocated/reserved now, peak so far."""
        parts = []
        for memory in self.devices:
            r = memory.read()
            parts.append(f"{memory.device} {_gib(r.allocated)}/{_gib(r.reserved)}/{_gib(r.peak)}")
        return " ".join(parts)

    def metric_readers(self) -> dict[str, dict[str, Callable[[], float]]]:
        """device -> {"allocated", "reserved", "peak"} -> bytes, read when called."""
        return {
            memory.device: {
                figure: (lambda m=memory, f=figure: float(getattr(m.read(), f)))
                for figure in ("allocated", "reserved", "peak")
            }
            for memory in self.devices
        }


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


class NvtxRanges:
    """Pushes an NVTX range named after each phase, so Nsight Systems shows phase
    names over the kernels they launched. Cross-thread spans (`start_span`) get none:
    an NVTX push/pop pair must stay on one thread.

    Build it with `nvtx_ranges()`, which returns None (after one log line) where CUDA is
    not available.
    """

    def __init__(self, push: Callable[[str], object], pop: Callable[[], object]) -> None:
        self._push = push
        self._pop = pop

    def phase_started(self, phase: Phase) -> None:
        self._push(phase.name)

    def phase_ended(self, phase: Phase, exc: BaseException | None) -> None:
        self._pop()

    def span_started(self, handle: SpanHandle) -> None:
        pass

    def span_ended(self, handle: SpanHandle, end_time_ns: int) -> None:
        pass


def nvtx_ranges(log: logging.Logger | None = None) -> NvtxRanges | None:
    """An NvtxRanges hook on CUDA machines; elsewhere None and one line saying so."""
    log = log or logging.getLogger("tracing")
    if not torch.cuda.is_available():
        log.warning("tracing: NVTX ranges off: CUDA is not available on this machine")
        return None
    return NvtxRanges(torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop)
