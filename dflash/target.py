"""Target models: the built-in tiny LM and Hugging Face causal LMs.

A `TargetModel` is frozen and in eval mode. `capture` keeps only the chosen
decoder layers' outputs (forward hooks) and, when logits are not wanted, stops the
forward right after the last needed layer so later layers never run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dflash.data import MASK_ID, ByteTokenizer
from dflash.documents import document_positions
from dflash.tiny import TinyLM, load_tiny_lm, prepare_builtin_target

__all__ = [
    "TargetError",
    "TargetModel",
    "TargetOutput",
    "default_target_layers",
    "load_target",
    "prepare_builtin_target",
    "validate_target_layers",
]

BUILTIN_PREFIX = "builtin:"
BUILTIN_NAMES = ("tiny",)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "org/name" or a legacy "name"


class TargetError(ValueError):
    """A target that cannot be used (bad spec, not a causal LM, bad layer ids)."""


@dataclass
class TargetOutput:
    hidden: Tensor  # [B, T, K*D]: chosen layers' outputs concatenated in the order asked
    logits: Tensor | None  # [B, T, V] or None when not asked for
    final_hidden: Tensor | None = None  # [B, T, D] final-norm output (the LM head's input)


class _StopForward(Exception):
    """Raised from a hook to end the forward once every needed layer has run."""


def default_target_layers(num_layers: int, k: int) -> list[int]:
    """k layer ids spread evenly from layer 1 to layer num_layers-3 (both included).

    Shallow targets clamp the range into [0, num_layers-1], so ids may repeat there.
    """
    if num_layers < 1 or k < 1:
        raise TargetError(f"need num_layers >= 1 and k >= 1, got {num_layers} and {k}")
    first = min(1, num_layers - 1)
    last = max(first, num_layers - 3)
    if k == 1:
        return [(first + last) // 2]
    return [round(first + i * (last - first) / (k - 1)) for i in range(k)]


def validate_target_layers(ids: list[int], num_layers: int) -> None:
    if not ids:
        raise TargetError("target layer ids are empty: give at least one id")
    for i in ids:
        if not 0 <= i < num_layers:
            raise TargetError(
                f"target layer id {i} is out of range: the target has {num_layers} layers "
                f"(valid ids 0..{num_layers - 1})"
            )


class TargetModel(nn.Module):
    """A frozen causal LM whose decoder layers' outputs can be captured."""

    def __init__(
        self,
        model: nn.Module,
        layers: nn.ModuleList,
        *,
        spec: str,
        tokenizer: Any,
        mask_token_id: int | None,
        num_heads: int,
        intermediate_size: int,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self._layers = layers  # registered through self.model already
        self.spec, self.tokenizer, self.mask_token_id = spec, tokenizer, mask_token_id
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.vocab_size = self.lm_head.out_features
        self.hidden_size = self.embed_tokens.embedding_dim
        self.num_layers = len(layers)
        self.num_heads, self.intermediate_size = num_heads, intermediate_size
        self.head_dim = self.hidden_size // num_heads
        self.rope_theta = rope_theta

    def train(self, mode: bool = True) -> TargetModel:
        # Frozen: never leave eval mode (dropout etc. would change the features).
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _run(self, input_ids: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        if not self._is_hf:
            return self.model(input_ids, doc_ids)
        # No KV cache: it would hold every layer's keys/values for nothing.
        if doc_ids is None:
            return self.model(input_ids=input_ids, use_cache=False).logits
        # Positions restarting per document, no 2D mask and no cache: transformers
        # then builds a block-diagonal causal mask from the position resets.
        positions = document_positions(doc_ids)
        return self.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits

    @property
    def _is_hf(self) -> bool:
        return not isinstance(self.model, TinyLM)

    def final_norm(self) -> nn.Module:
        """The norm whose output feeds the LM head."""
        decoder = self.model.get_decoder() if self._is_hf else self.model
        norm = getattr(decoder, "norm", None)
        if not isinstance(norm, nn.Module):
            raise TargetError(f"cannot find the final norm of {type(self.model).__name__}")
        return norm

    @torch.no_grad()
    def capture(
        self,
        input_ids: Tensor,
        layer_ids: list[int],
        with_logits: bool,
        with_final_hidden: bool = False,
        doc_ids: Tensor | None = None,
    ) -> TargetOutput:
        """input_ids[B, T] -> hidden[B, T, K*D] (+ logits[B, T, V] when with_logits).

        with_final_hidden adds the final-norm output [B, T, D]: soft labels from it and
        the LM head need no logits; the forward then stops before the LM head.
        doc_ids[B, T] (packed rows) keeps every document's attention to itself.
        """
        validate_target_layers(layer_ids, self.num_layers)
        wanted = sorted(set(layer_ids))
        kept: dict[int | str, Tensor] = {}
        last = wanted[-1]
        runs_to_norm = with_final_hidden and not with_logits

        def make_hook(i: int | str) -> Callable[..., None]:
            def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                kept[i] = output[0] if isinstance(output, tuple) else output
                if i == "norm" and runs_to_norm:
                    raise _StopForward
                if i == last and not (with_logits or with_final_hidden):
                    raise _StopForward

            return hook

        handles = [self._layers[i].register_forward_hook(make_hook(i)) for i in wanted]
        if with_final_hidden:
            handles.append(self.final_norm().register_forward_hook(make_hook("norm")))
        logits = None
        try:
            logits = self._run(input_ids, doc_ids)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        hidden = torch.cat([kept[i] for i in layer_ids], dim=-1)  # [B, T, K*D]
        return TargetOutput(hidden=hidden, logits=logits, final_hidden=kept.get("norm"))

    @torch.no_grad()
    def logits(self, input_ids: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """input_ids[B, T] -> logits[B, T, V]."""
        return self._run(input_ids, doc_ids)


def _builtin_target(
    name: str, device: torch.device | str, dtype: torch.dtype | None, log: Callable[[str], None]
) -> TargetModel:
    if name not in BUILTIN_NAMES:
        raise TargetError(
            f"unknown built-in target {BUILTIN_PREFIX}{name!r}: "
            f"choose one of {', '.join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES)}"
        )
    model = load_tiny_lm(prepare_builtin_target(log=log))
    return wrap_tiny(model, spec=BUILTIN_PREFIX + name).to(device=device, dtype=dtype)


def wrap_tiny(model: TinyLM, spec: str = "builtin:tiny") -> TargetModel:
    """A TargetModel around a TinyLM (also used by tests with untrained weights)."""
    cfg = model.config
    return TargetModel(
        model,
        model.layers,
        spec=spec,
        tokenizer=ByteTokenizer(),
        mask_token_id=MASK_ID,
        num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        rope_theta=cfg.rope_theta,
    )


def _find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise TargetError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


def _usable_mask_id(tokenizer: Any, num_embeddings: int) -> int | None:
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if isinstance(mask_id, int) and 0 <= mask_id < num_embeddings:
        return mask_id
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _hf_target(spec: str, device: torch.device | str, dtype: torch.dtype | None) -> TargetModel:
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
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32)
    except (ValueError, KeyError) as err:
        raise TargetError(f"target {spec} is not a causal LM: {_first_line(err)}") from err
    except OSError as err:
        where = "" if path.exists() else " (no such local directory; tried the hub)"
        raise TargetError(f"cannot load target {spec}{where}: {_first_line(err)}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (ValueError, OSError, KeyError) as err:
        raise TargetError(
            f"cannot load the tokenizer of target {spec}: {_first_line(err)}"
        ) from err
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        raise TargetError(f"target {spec} has no linear LM head")
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    layers = _find_decoder_layers(model, cfg.num_hidden_layers)
    rope_theta = getattr(cfg, "rope_theta", None) or 10000.0
    target = TargetModel(
        model,
        layers,
        spec=spec,
        tokenizer=tokenizer,
        mask_token_id=_usable_mask_id(tokenizer, model.get_input_embeddings().num_embeddings),
        num_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        rope_theta=float(rope_theta),
    )
    return target.to(device)


def load_target(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    log: Callable[[str], None] = print,
) -> TargetModel:
    """`builtin:tiny` (prepared and cached on first use), a local HF directory or a hub id."""
    if spec.startswith(BUILTIN_PREFIX):
        return _builtin_target(spec[len(BUILTIN_PREFIX) :], device, dtype, log)
    return _hf_target(spec, device, dtype)
