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

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch

_DEVICE_RE = re.compile(r"^(cpu|cuda|mps)(?::(\d+))?$")


class DeviceError(ValueError):
    """A device name that is malformed or not present on this machine."""


def _available_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    return 1


def parse_device(name: str, flag: str = "--devices") -> torch.device:
    """One validated device; `flag` names the option in the error message."""
    text = name.strip().lower()
    match = _DEVICE_RE.match(text)
    if match is None:
        raise DeviceError(f"unknown device {name!r} in {flag}: expected cpu or cuda:N")
    kind, index_text = match.group(1), match.group(2)
    if kind == "cpu":
        if index_text not in (None, "0"):
            raise DeviceError(f"unknown device {name!r} in {flag}: use plain 'cpu'")
        return torch.device("cpu")
    count = _available_count(kind)
    index = int(index_text) if index_text is not None else 0
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


# ----------------------------------------------------------- per-device model parts


def _capture_fn(target: Any, layer_ids: list[int], with_logits: bool, device: torch.device):
    def forward(batch: Any) -> Any:
        with torch.no_grad():
            ids = batch.input_ids.to(device, non_blocking=True)
            return target.capture(ids, layer_ids, with_logits=with_logits)

    return forward


def target_forwards(run: Any, devices: list[torch.device]) -> list[tuple[torch.device, Any]]:
    """One target per thread: `capture` hooks the module, so threads cannot share one."""
    from dflash import target as target_mod

    soft = run.cfg.objective.use_soft_labels
    forwards = [
        (run.target_device, _capture_fn(run.target, run.layer_ids, soft, run.target_device))
    ]
    for device in devices[1:]:
        dtype = next(run.target.parameters()).dtype
        target = target_mod.load_target(run.cfg.target.spec, device, dtype, log=lambda _: None)
        forwards.append((device, _capture_fn(target, run.layer_ids, soft, device)))
    return forwards


def mover(device: torch.device):
    def move(batch: Any, target_out: Any) -> tuple[Any, Any]:
        logits = target_out.logits
        out = dataclasses.replace(
            target_out,
            hidden=target_out.hidden.to(device, non_blocking=True),
            logits=None if logits is None else logits.to(device, non_blocking=True),
        )
        return batch.to(device), out

    return move
