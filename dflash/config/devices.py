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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash.config.checks import split_device_name
from dflash.config.settings import PipelineConfig
from dflash.errors import DFlashError


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
        auto_target if _is_auto(target_spec) else parse_devices(target_spec, "--target-devices")
    )
    drafters = (
        auto_drafter if _is_auto(drafter_spec) else parse_devices(drafter_spec, "--drafter-devices")
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
    module docstring); every part of the run takes its devices from the result."""
    targets, drafters = resolve_devices(
        cfg.target_devices, cfg.drafter_devices, local_rank, local_world_size
    )
    return Placement(tuple(targets), tuple(drafters))
