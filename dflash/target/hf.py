"""Hugging Face causal LMs as targets: loading and stop tokens.

transformers is imported only when such a target loads, so it stays optional.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dflash.errors import first_line
from dflash.target.geometry import TargetError, geometry_from_hf_config
from dflash.target.model import TargetModel

__all__ = [
    "can_load_head_only",
    "hf_stop_token_ids",
    "hub_unreachable",
    "load_hf_head",
    "load_hf_target",
]

HUB_PROBE_S = 3.0
"""How long a hub lookup waits to learn whether the hub can be reached at all: without
network, transformers' own retries take about half a minute and a dozen log lines."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "org/name" or a legacy "name"


def _find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise TargetError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


def load_hf_target(spec: str, device: torch.device | str, dtype: torch.dtype | None) -> TargetModel:
    path = Path(spec).expanduser()
    if not path.exists() and not _HUB_ID.match(spec):
        raise TargetError(f"target path does not exist: {spec}")
    if path.exists() and not (path / "config.json").is_file():
        raise TargetError(f"target {spec} is not a Hugging Face model directory (no config.json)")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise TargetError(
            "Hugging Face targets need transformers: pip install 'dflash-train[hf]'"
        ) from err
    source = str(path) if path.exists() else spec
    unreachable = None if path.exists() else hub_unreachable()
    cached_only = {"local_files_only": True} if unreachable else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype or torch.float32, **cached_only
        )
    except (ValueError, KeyError) as err:
        raise TargetError(f"target {spec} is not a causal LM: {first_line(err)}") from err
    except (SafetensorError, RuntimeError) as err:  # a truncated or mismatched weights file
        raise TargetError(
            f"cannot load target {spec}: its weights are damaged or do not match its config "
            f"({first_line(err)})"
        ) from None
    except OSError as err:
        if unreachable:
            raise TargetError(
                f"cannot load target {spec}: no such local directory, not in the Hugging Face "
                f"cache, and the hub cannot be reached from here ({unreachable})"
            ) from None
        where = "" if path.exists() else " (no such local directory; tried the hub)"
        raise TargetError(f"cannot load target {spec}{where}: {first_line(err)}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **cached_only)
    except (ValueError, OSError, KeyError) as err:
        raise TargetError(f"cannot load the tokenizer of target {spec}: {first_line(err)}") from err
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        raise TargetError(f"target {spec} has no linear LM head")
    geometry = geometry_from_hf_config(model.config)
    layers = _find_decoder_layers(model, geometry.num_layers)
    target = TargetModel(
        model,
        layers,
        spec=spec,
        tokenizer=tokenizer,
        geometry=geometry,
        stop_token_ids=hf_stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
    )
    return target.to(device)


def _weight_files(path: Path) -> dict[str, Path] | None:
    """Tensor name -> safetensors file of a local directory, or None without them."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise TargetError(f"{index} is unreadable: {first_line(err)}") from None
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def can_load_head_only(spec: str) -> bool:
    """A local Hugging Face directory whose weights are safetensors files."""
    path = Path(spec).expanduser()
    return (path / "config.json").is_file() and (
        (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file()
    )


def load_hf_head(spec: str, dtype: torch.dtype | None) -> TargetModel:
    """The target's embedding, LM head and final norm (and its tokenizer and config), on
    the CPU; its decoder layers are built on the meta device and never hold weights, so
    a 700B target costs here what its embedding and head cost. For training from
    hidden-state files: anything that would run the decoder fails at once."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(spec).expanduser()
    files = _weight_files(path)
    if files is None:
        raise TargetError(f"target {spec} has no safetensors weights to read its head from")
    dtype = dtype or torch.float32
    try:
        config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (ValueError, OSError, KeyError) as err:
        raise TargetError(f"cannot read target {spec}: {first_line(err)}") from None
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    norm = getattr(decoder, "norm", None)
    if not isinstance(head, nn.Linear) or not isinstance(norm, nn.Module):
        raise TargetError(f"target {spec}: cannot find its LM head and final norm")
    wanted = {id(m): m for m in (embed, head, norm)}
    names = {name: module for name, module in model.named_modules() if id(module) in wanted}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for prefix, module in names.items():
        module.to_empty(device="cpu")
        for pname, param in module.named_parameters(recurse=False):
            key = f"{prefix}.{pname}"
            if key not in files and module is head and tied:
                continue  # tied: the embedding's rows, copied below
            if key not in files:
                raise TargetError(f"target {spec}: its weights have no {key!r}")
            with safe_open(str(files[key]), framework="pt") as f:
                with torch.no_grad():
                    param.copy_(f.get_tensor(key).to(dtype))
    if tied:
        head.weight = embed.weight
    geometry = geometry_from_hf_config(model.config)
    layers = _find_decoder_layers(model, geometry.num_layers)
    target = TargetModel(model, layers, spec=spec, tokenizer=tokenizer, geometry=geometry,
                         stop_token_ids=hf_stop_token_ids(tokenizer, getattr(
                             model, "generation_config", None)))  # fmt: skip
    target.head_only = True
    return target


def hub_unreachable(timeout_s: float = HUB_PROBE_S) -> str | None:
    """Why the Hugging Face hub cannot be reached now (offline mode, no DNS, no route), or
    None when a TCP connection to it opens within `timeout_s`."""
    from huggingface_hub import constants  # with transformers: optional

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str | None] = []

    def probe() -> None:  # getaddrinfo has no timeout of its own: a thread bounds it
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{host}: {exc.strerror or type(exc).__name__}")

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else f"{host}: no answer within {timeout_s:.0f} s"


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def hf_stop_token_ids(tokenizer: Any, generation_config: Any) -> tuple[int, ...]:
    """EOS of the tokenizer plus the generation config's EOS ids (chat models list several)."""
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None))
    ids += _as_ids(getattr(generation_config, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))
