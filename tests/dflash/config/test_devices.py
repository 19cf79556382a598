"""Device names: parsing, availability checks, default split."""

from __future__ import annotations

import pytest
import torch

from dflash.config import devices
from dflash.config.devices import DeviceError, default_devices, parse_devices, resolve_devices


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


TORCHRUN_2_GPUS = [
    # (rank, devices option, GPUs on the node, expected targets, expected drafters)
    (0, {}, 2, ["cuda:0"], ["cuda:0"]),  # auto: one GPU per rank serves both sides
    (1, {}, 2, ["cuda:1"], ["cuda:1"]),
    (0, {}, 4, ["cuda:0"], ["cuda:2"]),  # auto: two GPUs per rank
    (1, {}, 4, ["cuda:1"], ["cuda:3"]),
    (0, {"target_devices": ["cuda:0"], "drafter_devices": ["cuda:1"]}, 2, ["cuda:0"], ["cuda:1"]),
    (1, {"target_devices": ["cuda:0"], "drafter_devices": ["cuda:1"]}, 2, ["cuda:0"], ["cuda:1"]),
    (1, {"target_devices": ["cuda:1"], "drafter_devices": ["cuda:1"]}, 2, ["cuda:1"], ["cuda:1"]),
]


def _simulate_torchrun_node(monkeypatch: pytest.MonkeyPatch, rank: int, gpus: int) -> None:
    """A node with `gpus` GPUs under `torchrun --nproc-per-node 2`, seen from `rank`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    node = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2}
    for name, value in node.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize(("rank", "opts", "gpus", "targets", "drafters"), TORCHRUN_2_GPUS)
def test_placement_is_decided_once_per_rank_and_used_by_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path, rank, opts, gpus, targets, drafters
) -> None:
    """run_pipeline decides the rank's devices once (start_run), local-rank aware, and
    builds the run on exactly those."""
    from dflash.config.devices import decide_placement
    from dflash.config.settings import config_from_options
    from dflash.pipeline.distributed import dist_info_from_env
    from dflash.run import pipelined as pipeline
    from dflash.run import start as run_start
    from dflash.run import wiring

    _simulate_torchrun_node(monkeypatch, rank, gpus)
    cfg = config_from_options({"output_dir": str(tmp_path), **opts})
    info = dist_info_from_env()
    placement = decide_placement(cfg.pipeline, info.local_rank, info.local_world_size)
    assert [str(d) for d in placement.targets] == targets
    assert [str(d) for d in placement.drafters] == drafters

    seen = []

    class Built(Exception):
        pass

    def build_run(cfg_, placement_, log):
        seen.append(placement_)
        raise Built

    monkeypatch.setattr(run_start, "init_distributed", lambda info, device: None)
    monkeypatch.setattr(wiring, "build_run", build_run)
    with pytest.raises(Built):
        pipeline.run_pipeline(cfg, log=lambda _: None)
    assert seen == [placement]
