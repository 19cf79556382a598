"""The resource of a run's telemetry says where each rank ran (issue 39, item 2)."""

from __future__ import annotations

import os
import socket

from dflash.config.settings import TelemetryConfig
from dflash.observe.observer import rank_placement, tracing_config
from tracing.telemetry import build_resource


def test_a_ranks_resource_names_its_node_devices_and_config() -> None:
    env = {"GROUP_RANK": "1", "NODE_RANK": "5"}  # torchrun's GROUP_RANK first
    placement = rank_placement(4, 1, ("cpu", "cpu"), {"run": {"steps": 3}}, env=env)
    cfg = tracing_config(TelemetryConfig(), rank=3, run_id="r-1", **placement)
    attributes = build_resource(cfg).attributes
    assert attributes["host.name"] == socket.gethostname()
    assert attributes["process.pid"] == os.getpid()
    assert (attributes["dflash.rank"], attributes["dflash.world_size"]) == (3, 4)
    assert (attributes["dflash.local_rank"], attributes["dflash.node.rank"]) == (1, 1)
    model = attributes["dflash.device.model"]
    assert model and "," not in model  # two CPU replicas: one model
    digest = attributes["dflash.config.hash"]
    assert (
        len(digest) == 16
        and digest == rank_placement(1, config={"run": {"steps": 3}})["config_hash"]
    )
    assert digest != rank_placement(1, config={"run": {"steps": 4}})["config_hash"]


def test_a_single_process_says_nothing_of_nodes() -> None:
    placement = rank_placement(1, env={"NODE_RANK": ""})
    assert placement["node_rank"] is None and placement["device_model"] is None
    assert rank_placement(2, env={"NODE_RANK": "2"})["node_rank"] == 2
