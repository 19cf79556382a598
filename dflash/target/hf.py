"""Hugging Face causal LMs as targets: loading and stop tokens.

transformers is imported only when such a target loads, so it stays optional.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from urllib.parse import ParseResult, urlparse

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dflash.data.tokenizer import Tokenizer, encode_texts
from dflash.errors import first_line
from dflash.target.geometry import TargetError, geometry_from_hf_config
from dflash.target.model import TargetModel

__all__ = [
    "can_load_head_only",
    "check_not_a_drafter",
    "check_tokenizer",
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
    check_not_a_drafter(spec)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise TargetError(
            "Hugging Face targets need transformers: pip install 'dflash-train[hf]'"
        ) from err
    source = str(path) if path.exists() else spec
    unreachable = None if path.exists() else hub_unreachable()
    cached_only = {"local_files_only": True} if unreachable else {}
    _check_decoder_config(spec, source, cached_only)
    try:  # before the weights: a folder without a tokenizer is told in seconds
        tokenizer = AutoTokenizer.from_pretrained(source, **cached_only)
    except (ValueError, OSError, KeyError) as err:
        if unreachable:
            raise _unreachable(spec, unreachable) from None
        if isinstance(err, OSError) and not path.exists():
            raise TargetError(
                f"cannot load target {spec} (no such local directory; tried the hub): "
                f"{first_line(err)}"
            ) from err
        raise TargetError(f"cannot load the tokenizer of target {spec}: {first_line(err)}") from err
    check_tokenizer(spec, tokenizer)
    try:
        with _quiet_transformers():  # what it would warn of is refused below, in one line
            model, loading = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype or torch.float32, output_loading_info=True, **cached_only
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
            raise _unreachable(spec, unreachable) from None
        where = "" if path.exists() else " (no such local directory; tried the hub)"
        raise TargetError(f"cannot load target {spec}{where}: {first_line(err)}") from err
    check_loading_info(spec, loading)
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


def _unreachable(spec: str, why: str) -> TargetError:
    return TargetError(
        f"cannot load target {spec}: no such local directory, not in the Hugging Face "
        f"cache, and the hub cannot be reached from here ({why})"
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings (its table of missing and unexpected weights) held back."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def _some(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_loading_info(spec: str, loading: Mapping[str, Iterable[object]]) -> None:
    """A weights file with a tensor missing (transformers would initialize it at random
    and train on) or with tensors the model does not have is refused, naming them."""
    found = []
    for key, what in (
        ("missing_keys", "missing"),
        ("unexpected_keys", "unexpected"),
        ("mismatched_keys", "of another shape"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in loading.get(key) or ())
        if names:
            found.append(f"{len(names)} {what} ({_some(names)})")
    if found:
        raise TargetError(
            f"target {spec}: its weights do not match its config: {'; '.join(found)}; the "
            "weights file is damaged or of another model (transformers would fill what is "
            "missing at random)"
        )


DRAFTER_ARCHITECTURE = "DFlashDraftModel"  # dflash.drafter.io.ARCHITECTURE
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
PROBE_TEXT = "def add(a, b):\n    return a + b\n"
"""Text every target's tokenizer must encode (the tokenizer check, the forward check)."""


def check_not_a_drafter(spec: str) -> None:
    """A saved DFlash drafter given as the target (its config.json names the drafter
    architecture) is one line saying so, before anything loads."""
    path = Path(spec).expanduser()
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not (isinstance(architectures, list) and DRAFTER_ARCHITECTURE in architectures):
        return
    try:
        meta = json.loads((path / "dflash_train.json").read_text(encoding="utf-8"))
        named = f" ({meta['target']}, its dflash_train.json says)"
    except (OSError, ValueError, KeyError, TypeError):
        named = ""
    raise TargetError(
        f"target {spec} is a saved DFlash drafter ({DRAFTER_ARCHITECTURE}), not a target "
        f"model: give the model it drafts for as --target{named}, and this folder as --drafter"
    )


def check_tokenizer(spec: str, tokenizer: Tokenizer) -> None:
    """A tokenizer that encodes text to no tokens (transformers makes an empty one for a
    folder without tokenizer files) is one line naming the target."""
    if len(encode_texts(tokenizer, [PROBE_TEXT])[0]):
        return
    path = Path(spec).expanduser()
    why = ""
    if path.is_dir() and not any((path / name).is_file() for name in VOCAB_FILES):
        why = (
            ": its folder has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, "
            "...); copy them from the model it came from"
        )
    raise TargetError(
        f"target {spec} has no usable tokenizer (it encodes text to no tokens; "
        f"{len(tokenizer)} in its vocabulary){why}"
    )


def _check_decoder_config(spec: str, source: str, cached_only: dict[str, bool]) -> None:
    """A target a drafter cannot follow (a GPT-2: no rotary decoder) is refused from its
    config, before gigabytes of weights load or download."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(source, **cached_only)
    except (OSError, ValueError, KeyError):
        return  # loading the model names what is wrong
    if getattr(config, "model_type", None) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return  # not a causal LM at all: loading says so
    try:
        geometry_from_hf_config(config)
    except TargetError as err:
        raise TargetError(f"target {spec}: {first_line(err).removeprefix('target ')}") from None


def weight_files(path: Path) -> dict[str, Path] | None:
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
    check_not_a_drafter(spec)
    files = weight_files(path)
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
    check_tokenizer(spec, tokenizer)
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
    stops = hf_stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    target = TargetModel(
        model, layers, spec=spec, tokenizer=tokenizer, geometry=geometry, stop_token_ids=stops
    )
    target.head_only = True
    return target


_PROBED: dict[str, str | None] = {}  # endpoint -> its answer, once per process


def hub_unreachable(timeout_s: float = HUB_PROBE_S) -> str | None:
    """Why the Hugging Face hub cannot be used now (offline mode, no DNS, no route, an
    endpoint that takes the connection but never answers), or None when it answers an
    HTTP request within `timeout_s`, one deadline for the whole probe (name lookup,
    connection, TLS, answer). Asked once per process: every later lookup of the run
    (config, tokenizer, weights) gets the same answer without waiting again."""
    from huggingface_hub import constants  # with transformers: optional

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = constants.ENDPOINT
    if endpoint not in _PROBED:
        _PROBED[endpoint] = _probe_hub(endpoint, timeout_s)
    return _PROBED[endpoint]


def _probe_hub(endpoint: str, timeout_s: float) -> str | None:
    url = urlparse(endpoint)
    host = url.hostname or "huggingface.co"
    outcome: list[str | None] = []

    def probe() -> None:  # getaddrinfo has no timeout of its own: a thread bounds it all
        try:
            connection = _hub_connection(url, timeout_s)
            try:
                connection.request("HEAD", url.path or "/")
                connection.getresponse()  # any status: the hub answers
            finally:
                connection.close()
            outcome.append(None)
        except (OSError, http.client.HTTPException) as exc:
            outcome.append(f"{host}: {getattr(exc, 'strerror', None) or first_line(exc)}")

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else f"{host}: no answer within {timeout_s:g} s"


def _hub_connection(url: ParseResult, timeout_s: float) -> http.client.HTTPConnection:
    """A connection to the hub as huggingface_hub would make it: through the proxy of
    HTTPS_PROXY/HTTP_PROXY (tunnelled) unless NO_PROXY names the host."""
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    secure = url.scheme == "https"
    kind = http.client.HTTPSConnection if secure else http.client.HTTPConnection
    proxy = urllib.request.getproxies().get(url.scheme)
    if not proxy or urllib.request.proxy_bypass(host):
        return kind(host, port, timeout=timeout_s)
    via = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    connection = kind(via.hostname or "", via.port or 80, timeout=timeout_s)
    connection.set_tunnel(host, port)
    return connection


def _as_ids(value: int | list[int] | tuple[int, ...] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def hf_stop_token_ids(tokenizer: Tokenizer, generation_config: object) -> tuple[int, ...]:
    """EOS of the tokenizer plus the generation config's EOS ids (chat models list several)."""
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None))
    ids += _as_ids(getattr(generation_config, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))


def load_stop_token_ids(spec: str, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The stop tokens of a target whose weights do not load here (a served one): its
    tokenizer's EOS and its generation config's, where it has one."""
    generation_config = None
    try:
        from transformers import GenerationConfig

        path = Path(spec).expanduser()
        generation_config = GenerationConfig.from_pretrained(str(path) if path.exists() else spec)
    except (ImportError, OSError, ValueError):
        pass  # no generation config: the tokenizer's EOS alone
    return hf_stop_token_ids(tokenizer, generation_config)
