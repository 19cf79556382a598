"""Device lists for the pipeline: parsing, validation and the default split.

Devices are named as torch names them (`cpu`, `cuda:0`, ...). Every name is checked
against this machine before any work starts, so `cuda:3` on a two-GPU host fails
with one line instead of a CUDA error deep inside a thread. The same device may
appear on both sides, and more than once on one side (several threads sharing it).

Default split: without GPUs, `cpu` for the target and the drafter. With GPUs, each
rank (one per process under torchrun) takes its slice of the visible GPUs, GPU i
going to local rank `i % local_world_size`; a slice of one GPU is shared by both
sides, and a larger slice gives its first half to the target and the rest to the
drafters. A rank with no GPU of its own (more ranks than GPUs) shares GPU
`local_rank % gpu_count`.

Precision (--precision): `bf16` runs the drafter's forward under bf16 autocast and the
frozen target in bf16, `fp32` everything in fp32, `auto` bf16 where the hardware has it
natively and it pays: CUDA (as every CUDA run did before the option), and a CPU whose
flags name AVX512-BF16 or AMX-BF16 (about 3x fp32's matmul rate there) for a model of
hidden size AUTO_BF16_MIN_HIDDEN or more. A CPU without them emulates bf16 at a fraction
of fp32's speed, so `bf16` on it is refused before any model loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import torch

from dflash.config.checks import split_device_name
from dflash.config.settings import PipelineConfig
from dflash.errors import DFlashError

Resolved = Literal["fp32", "bf16"]
# /proc/cpuinfo flags of the x86 instructions that multiply bf16 matrices natively.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Under `auto` a CPU runs bf16 for models at least this wide: below it autocast's casts
# cost what the bf16 matmuls save (a drafter step on an AVX512-BF16 CPU, 2 threads:
# hidden 128 1.0x, 256 1.0-1.3x, 576 2.9x; bench/precision.py).
AUTO_BF16_MIN_HIDDEN = 512


class DeviceError(DFlashError):
    """A device name that is malformed or not present on this machine."""


def _available_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    return 1


def parse_device(name: str, flag: str = "--devices") -> torch.device:
    """One validated device; `flag` names the option in the error message."""
    parsed = split_device_name(name)
    if parsed is None:
        raise DeviceError(f"unknown device {name!r} in {flag}: expected cpu or cuda:N")
    kind, given_index = parsed
    if kind == "cpu":
        if given_index not in (None, 0):
            raise DeviceError(f"unknown device {name!r} in {flag}: use plain 'cpu'")
        return torch.device("cpu")
    count = _available_count(kind)
    index = given_index if given_index is not None else 0
    if index >= count:
        have = f"{count} {kind} device(s)" if count else f"no {kind} device"
        raise DeviceError(f"device {name!r} in {flag} is not available: this machine has {have}")
    return torch.device(kind, index)


def parse_devices(spec: str | Sequence[str], flag: str = "--devices") -> list[torch.device]:
    """`'cuda:0,cuda:1'` or a list of names -> validated devices, order kept."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    if not names or any(not n.strip() for n in names):
        raise DeviceError(f"empty device name in {flag}: {spec!r}")
    return [parse_device(n, flag) for n in names]


def default_devices(
    local_rank: int = 0, local_world_size: int = 1
) -> tuple[list[torch.device], list[torch.device]]:
    """(target devices, drafter devices) for this rank; see the module docstring."""
    gpu_count = _available_count("cuda")
    if gpu_count == 0:
        cpu = torch.device("cpu")
        return [cpu], [cpu]
    mine = [i for i in range(gpu_count) if i % local_world_size == local_rank]
    if not mine:
        mine = [local_rank % gpu_count]
    if len(mine) == 1:
        only = torch.device("cuda", mine[0])
        return [only], [only]
    half = len(mine) // 2
    return (
        [torch.device("cuda", i) for i in mine[:half]],
        [torch.device("cuda", i) for i in mine[half:]],
    )


def _is_auto(spec: str | Sequence[str] | None) -> bool:
    if not spec:
        return True
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    return [n.strip().lower() for n in names] == ["auto"]


def resolve_devices(
    target_spec: str | Sequence[str] | None,
    drafter_spec: str | Sequence[str] | None,
    local_rank: int = 0,
    local_world_size: int = 1,
) -> tuple[list[torch.device], list[torch.device]]:
    """Devices from the options; an empty option or `auto` takes `default_devices`."""
    auto_target, auto_drafter = default_devices(local_rank, local_world_size)
    targets = (
        parse_devices(target_spec, "--target-devices")
        if target_spec and not _is_auto(target_spec)
        else auto_target
    )
    drafters = (
        parse_devices(drafter_spec, "--drafter-devices")
        if drafter_spec and not _is_auto(drafter_spec)
        else auto_drafter
    )
    kinds = {d.type for d in drafters}
    if len(kinds) > 1:
        # Gradients are averaged in one dtype/backend per step; mixing cpu and cuda
        # drafters would make the collective choice ambiguous.
        raise DeviceError(f"--drafter-devices mixes device types {sorted(kinds)}: use one type")
    return targets, drafters


def resolve_device(spec: str, flag: str = "--device") -> torch.device:
    """One device for both target and drafter: `auto` is cuda:0 when present, else cpu."""
    if _is_auto(spec):
        return torch.device("cuda", 0) if _available_count("cuda") else torch.device("cpu")
    return parse_device(spec, flag)


def cpu_bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The native-bf16 flags of this CPU (`cpuinfo`: the text of /proc/cpuinfo, read when
    None; a machine without it, as macOS, has none)."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return tuple(f for f in CPU_BF16_FLAGS if f in flags)


@cache
def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def native_bf16(device: torch.device, cpu_flags: tuple[str, ...] | None = None) -> bool:
    """Whether `device` multiplies bf16 natively: a CUDA device of compute capability 8.0
    or more, a CPU with one of CPU_BF16_FLAGS (`cpu_flags`: given, else this CPU's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        return bool(cpu_bf16_flags() if cpu_flags is None else cpu_flags)
    return False


def resolve_precision(
    precision: str,
    device: torch.device,
    hidden_size: int | None = None,
    cpu_flags: tuple[str, ...] | None = None,
) -> Resolved:
    """--precision on one device for a model of `hidden_size`: `bf16` or `fp32`. `auto`
    is bf16 on CUDA (as before the option), and on a CPU with native bf16 once the model
    is wide enough for it to pay (AUTO_BF16_MIN_HIDDEN; None: not known yet, fp32), else
    fp32. `bf16` on a device without native bf16 is a DeviceError naming it.
    `cpu_flags`: as in `native_bf16`."""
    if precision == "fp32":
        return "fp32"
    if precision == "auto":
        if device.type == "cuda":
            return "bf16"
        wide = hidden_size is not None and hidden_size >= AUTO_BF16_MIN_HIDDEN
        return "bf16" if wide and native_bf16(device, cpu_flags) else "fp32"
    if not native_bf16(device, cpu_flags):
        raise DeviceError(f"--precision bf16: {_no_bf16(device)}; use fp32 or auto")
    return "bf16"


def check_precision(precision: str, devices: Sequence[torch.device]) -> None:
    """`--precision bf16` on a device without native bf16: one DeviceError naming it,
    before any model loads."""
    for device in devices:
        resolve_precision(precision, device)


def _no_bf16(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        return f"device {device} ({name}, compute capability {major}.{minor}) has no native bf16"
    if device.type == "cpu":
        flags = " or ".join(CPU_BF16_FLAGS)
        return f"device cpu has no native bf16 (its /proc/cpuinfo flags name neither {flags})"
    return f"device {device} has no native bf16 here"


def precision_text(
    precision: str,
    device: torch.device,
    hidden_size: int | None = None,
    cpu_flags: tuple[str, ...] | None = None,
) -> str:
    """The start-up words for --precision on `device` (what `resolve_precision` chose,
    and under `auto` why)."""
    resolved = resolve_precision(precision, device, hidden_size, cpu_flags)
    what = "bf16 autocast, fp32 master weights" if resolved == "bf16" else "fp32"
    if precision != "auto":
        return f"precision: {what}"
    if device.type == "cuda":
        why = "CUDA"
    elif not native_bf16(device, cpu_flags):
        why = f"no native bf16 on {device}"
    else:
        flags = "/".join(cpu_bf16_flags() if cpu_flags is None else cpu_flags)
        size, floor = hidden_size if hidden_size is not None else "unknown", AUTO_BF16_MIN_HIDDEN
        cmp = ">=" if resolved == "bf16" else "<"
        why = f"{device} has {flags}, hidden size {size} {cmp} {floor}"
    return f"precision: {what} (auto: {why})"


@dataclass(frozen=True)
class Placement:
    """Where this rank runs its target threads and drafter replicas (decided once)."""

    targets: tuple[torch.device, ...]
    drafters: tuple[torch.device, ...]

    @property
    def target(self) -> torch.device:
        """The first target device: the run's own target lives here."""
        return self.targets[0]

    @property
    def drafter(self) -> torch.device:
        """The first drafter device: replica 0 (the run's own drafter) lives here."""
        return self.drafters[0]

    def describe(self) -> str:
        targets, drafters = (",".join(map(str, devs)) for devs in (self.targets, self.drafters))
        return f"targets {targets}, drafters {drafters}"


def decide_placement(
    cfg: PipelineConfig, local_rank: int = 0, local_world_size: int = 1
) -> Placement:
    """This rank's devices from --target-devices/--drafter-devices (`auto`: see the
    module docstring); every part of the run takes its devices from the result.
    `--precision bf16` on one of them without native bf16 is refused here, before any
    model loads."""
    targets, drafters = resolve_devices(
        cfg.target_devices, cfg.drafter_devices, local_rank, local_world_size
    )
    check_precision(cfg.precision, (*targets, *drafters))
    return Placement(tuple(targets), tuple(drafters))
