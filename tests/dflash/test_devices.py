"""Device names: parsing, availability checks, default split."""

from __future__ import annotations

import pytest
import torch

from dflash import devices
from dflash.devices import DeviceError, default_devices, parse_devices, resolve_devices


def test_cpu_parses_and_may_repeat() -> None:
    assert parse_devices("cpu") == [torch.device("cpu")]
    assert parse_devices("cpu, cpu") == [torch.device("cpu")] * 2
    assert parse_devices(["CPU"]) == [torch.device("cpu")]


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "tpu:0", "cpu:1"])
def test_unknown_device_names_the_value_and_flag(name: str) -> None:
    with pytest.raises(DeviceError, match=f"'{name}' in --target-devices"):
        parse_devices(name, "--target-devices")


def test_empty_entry_is_an_error() -> None:
    with pytest.raises(DeviceError, match="empty device name in --drafter-devices"):
        parse_devices("cpu,,cpu", "--drafter-devices")


def test_unavailable_cuda_index_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_available_count", lambda kind: 2 if kind == "cuda" else 1)
    assert parse_devices("cuda:0,cuda:1") == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(DeviceError) as info:
        parse_devices("cuda:0,cuda:3", "--drafter-devices")
    assert str(info.value) == (
        "device 'cuda:3' in --drafter-devices is not available: this machine has 2 cuda device(s)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_cuda_on_a_machine_without_gpus() -> None:
    with pytest.raises(DeviceError, match="'cuda:3' .* not available: this machine has no cuda"):
        parse_devices("cuda:3", "--target-devices")


@pytest.mark.parametrize(
    ("gpus", "local_rank", "local_world", "target", "drafter"),
    [
        (0, 0, 1, ["cpu"], ["cpu"]),
        (1, 0, 1, ["cuda:0"], ["cuda:0"]),
        (4, 0, 1, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]),
        (3, 0, 1, ["cuda:0"], ["cuda:1", "cuda:2"]),
        (8, 1, 2, ["cuda:1", "cuda:3"], ["cuda:5", "cuda:7"]),
        (2, 1, 2, ["cuda:1"], ["cuda:1"]),
        (2, 3, 4, ["cuda:1"], ["cuda:1"]),
    ],
)
def test_default_split(
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    local_rank: int,
    local_world: int,
    target: list[str],
    drafter: list[str],
) -> None:
    monkeypatch.setattr(devices, "_available_count", lambda kind: gpus if kind == "cuda" else 1)
    got_target, got_drafter = default_devices(local_rank, local_world)
    assert [str(d) for d in got_target] == target
    assert [str(d) for d in got_drafter] == drafter


def test_resolve_auto_and_explicit() -> None:
    auto_target, auto_drafter = default_devices()
    assert resolve_devices(("auto",), None) == (auto_target, auto_drafter)
    assert resolve_devices(("cpu", "cpu"), "cpu") == (
        [torch.device("cpu")] * 2,
        [torch.device("cpu")],
    )


def test_mixed_drafter_device_types_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_available_count", lambda kind: 1)
    with pytest.raises(DeviceError, match="mixes device types"):
        resolve_devices("cpu", "cpu,cuda:0")
