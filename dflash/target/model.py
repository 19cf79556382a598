"""The frozen target wrapped for the trainer: hidden-state capture, cached forwards and
the mask token of its drafter.

A `TargetModel` is frozen and in eval mode. `capture` keeps only the chosen decoder
layers' outputs (forward hooks) and, when logits are not wanted, stops the forward
right after the last needed layer so later layers never run. The kinds of target (the
built-in tiny LM, Hugging Face causal LMs) are built in dflash.target.load.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from dflash.config import checks
from dflash.data.chat import use_chat_template_kwargs
from dflash.data.documents import document_positions
from dflash.data.tokenizer import Tokenizer
from dflash.nn.kvcache import KVCache, crop_hf_cache
from dflash.target.geometry import TargetError, TargetGeometry, text_config
from dflash.target.tiny import TinyLM

if TYPE_CHECKING:
    from transformers import DynamicCache

    # A decoding cache: ours for the tiny target, Hugging Face's for theirs (`new_cache`).
    Cache = KVCache | DynamicCache

# Token ids of the data, as its arrays or as tensors (compared elementwise, then `.any()`).
TokenArray = np.ndarray | Tensor


@dataclass
class TargetOutput:
    hidden: Tensor  # [B, T, K*D]: chosen layers' outputs concatenated in the order asked
    logits: Tensor | None  # [B, T, V] or None when not asked for
    final_hidden: Tensor | None = None  # [B, T, D] final-norm output (the LM head's input)


@dataclass(frozen=True)
class MaskToken:
    """The embedding row used for masked block positions, and how it was chosen."""

    token_id: int
    source: str  # "tokenizer" | "spare-row" | "explicit" | "unused-special" | "unused-unk"
    text: str | None = None  # the token's text, for an unused special token

    def describe(self) -> str:
        how = {
            "tokenizer": "the tokenizer's mask token",
            "spare-row": "the first embedding row past the tokenizer's vocabulary",
            "explicit": "--mask-token-id",
            "unused-special": f"{self.text!r}: the tokenizer has no mask token and no spare "
            "embedding row, and this special token occurs in neither the training nor the "
            "held-out data",
            "unused-unk": f"{self.text!r}, the unknown token: the tokenizer has no mask token, "
            "no spare embedding row and no other special token the data leaves unused, and "
            "this one occurs in neither the training nor the held-out data (a byte-fallback "
            "tokenizer never writes it)",
        }[self.source]
        return f"mask token id {self.token_id} ({how})"


class NoMaskToken(TargetError):
    """Neither a mask token nor a spare row: a special token the data never uses may serve."""


def unused_special_token(
    tokenizer: Tokenizer, num_embeddings: int, token_ids: Iterable[TokenArray]
) -> MaskToken | None:
    """The first special token (by id) that occurs in none of `token_ids` (arrays of the
    training and held-out data, padding included): a row of the target's embedding the
    drafter can mask with, which every engine loading the drafter also has. The unknown
    token comes last, when no other special token is free."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    # Never a token the pipeline itself writes: padding (regeneration batches, short rows),
    # document ends and starts; the unknown token only as the last resort.
    for role in ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id"):
        special.discard(getattr(tokenizer, role, None))
    arrays = list(token_ids)
    for token_id in sorted(i for i in special if isinstance(i, int) and 0 <= i < num_embeddings):
        if _unused(token_id, arrays):
            return MaskToken(token_id, "unused-special", _token_text(tokenizer, token_id))
    return _unused_unk(tokenizer, num_embeddings, arrays)


def _unused_unk(
    tokenizer: Tokenizer, num_embeddings: int, arrays: list[TokenArray]
) -> MaskToken | None:
    """The last resort (Llama-2, Mistral-7B-v0.1, TinyLlama: BOS, EOS, UNK and nothing
    else): the unknown token, when it is no token the pipeline writes itself (padding,
    document ends and starts) and the data does not hold it."""
    unk = getattr(tokenizer, "unk_token_id", None)
    roles = ("pad_token_id", "eos_token_id", "bos_token_id")
    writes = {getattr(tokenizer, role, None) for role in roles}
    if not isinstance(unk, int) or not 0 <= unk < num_embeddings or unk in writes:
        return None
    if not _unused(unk, arrays):
        return None
    return MaskToken(unk, "unused-unk", _token_text(tokenizer, unk))


def _unused(token_id: int, arrays: list[TokenArray]) -> bool:
    return not any(bool((ids == token_id).any()) for ids in arrays)


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return str(tokenizer.convert_ids_to_tokens(token_id) or tokenizer.decode([token_id]))


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """Ids the tokenizer can produce (added tokens included)."""
    try:
        return len(tokenizer)
    except TypeError:
        return int(tokenizer.vocab_size)


def resolve_mask_token(
    tokenizer: Tokenizer, num_embeddings: int, explicit_id: int | None = None
) -> MaskToken:
    """An explicit id when given; else the tokenizer's mask token; else the first spare row."""
    if explicit_id is not None:
        if not 0 <= explicit_id < num_embeddings:
            raise TargetError(
                f"--mask-token-id {explicit_id} is out of range: the target has "
                f"{num_embeddings} embedding rows (valid ids 0..{num_embeddings - 1})"
            )
        return MaskToken(int(explicit_id), "explicit")
    tok_mask = getattr(tokenizer, "mask_token_id", None)
    if isinstance(tok_mask, int) and 0 <= tok_mask < num_embeddings:
        return MaskToken(tok_mask, "tokenizer")
    vocab = tokenizer_vocab_size(tokenizer)
    if vocab < num_embeddings:
        return MaskToken(vocab, "spare-row")
    raise NoMaskToken(
        f"no mask token: the tokenizer has none, all {num_embeddings} embedding rows are "
        "tokens and every special token occurs in the data; give --mask-token-id (an id the "
        "data never uses)"
    )


def check_mask_token_unused(mask_token_id: int, token_ids: Iterable[TokenArray]) -> None:
    """One-line error when the data contains the mask id (the drafter could not tell
    a masked position from that token). token_ids: arrays or tensors of token ids."""
    for ids in token_ids:
        if bool((ids == mask_token_id).any()):
            raise TargetError(
                f"--mask-token-id {mask_token_id} is a token the training data uses: "
                "choose an id the tokenizer never produces (e.g. a spare embedding row)"
            )


class _StopForward(Exception):
    """Raised from a hook to end the forward once every needed layer has run."""


def default_target_layers(num_layers: int, k: int) -> list[int]:
    """k distinct ascending layer ids spread evenly from layer 1 to layer num_layers-3
    (both included), the paper's range.

    A target too shallow for k layers in that range widens it, first up to L-2, then down
    to layer 0, last to L-1 (the last layer, which not every engine can capture): the
    ids never repeat, since no engine captures a layer twice. Where the range already
    held k layers, the ids are those of the paper's spread, unchanged.
    """
    if num_layers < 1 or k < 1:
        raise TargetError(f"need num_layers >= 1 and k >= 1, got {num_layers} and {k}")
    if k > num_layers:
        raise TargetError(
            f"--drafter-layers {k}: the default is one target layer per drafter layer, and "
            f"the target has only {num_layers} distinct layers: give --target-layers (at "
            f"most {num_layers} ascending ids) or fewer drafter layers"
        )
    first = min(1, num_layers - 1)
    last = max(first, num_layers - 3)
    if k == 1:
        return [(first + last) // 2]
    wider = max(last, num_layers - 2)
    ranges = ((first, last), (first, wider), (0, wider), (0, num_layers - 1))
    first, last = next((lo, hi) for lo, hi in ranges if hi - lo + 1 >= k)  # the last fits
    # Steps of at least 1 round to distinct integers: |round(x) - x| <= 1/2.
    return [round(first + i * (last - first) / (k - 1)) for i in range(k)]


def validate_target_layers(ids: list[int], num_layers: int) -> None:
    """The drafter's captured layers: in range, each once, ascending (checks.layer_ids)."""
    check_layers_in_range(ids, num_layers)
    reason = checks.layer_ids(tuple(ids))  # the config's check, for ids of the Python API
    if reason is not None:
        raise TargetError(f"--target-layers {','.join(map(str, ids))} is invalid: {reason}")


def check_layers_in_range(ids: list[int], num_layers: int) -> None:
    if not ids:
        raise TargetError("target layer ids are empty: give at least one id")
    for i in ids:
        if not 0 <= i < num_layers:
            raise TargetError(
                f"target layer id {i} is out of range: the target has {num_layers} layers "
                f"(valid ids 0..{num_layers - 1})"
            )


def choose_target_layers(given: Sequence[int] | None, num_layers: int, k: int) -> list[int]:
    """The layers a drafter with k layers captures: `given` (--target-layers) checked
    against the target, else the default spread."""
    if given is None:
        return default_target_layers(num_layers, k)
    ids = list(given)
    validate_target_layers(ids, num_layers)
    return ids


def last_layer_warning(ids: Sequence[int], num_layers: int) -> str | None:
    """One line when the target's last decoder layer is among `ids`: this project and
    vLLM capture its output before the final norm, but SGLang cannot capture it and
    speculators' DFlash converter drops it."""
    last = num_layers - 1
    if last not in ids:
        return None
    return (
        f"warning: target layer {last} is the target's last decoder layer: vLLM serves the "
        "drafter as trained (its output before the final norm), but SGLang cannot capture "
        f"it and speculators' converter drops it; choose --target-layers below {last} for them"
    )


class TargetModel(nn.Module):
    """A frozen causal LM whose decoder layers' outputs can be captured."""

    def __init__(
        self,
        model: nn.Module,
        layers: nn.ModuleList,
        *,
        spec: str,
        tokenizer: Tokenizer,
        geometry: TargetGeometry,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self._layers = layers  # registered through self.model already
        # `capture` hooks the module's layers for the time of a forward: any other forward
        # of this module meanwhile (an evaluation while training) must hold this lock too.
        self.forward_lock = threading.RLock()
        self.spec, self.tokenizer, self.geometry = spec, tokenizer, geometry
        # Any: keywords of the tokenizer's chat template, passed on as they are
        self.chat_template_kwargs: dict[str, Any] = {}
        self.data_mask_token: MaskToken | None = None
        self.stop_token_ids = tuple(stop_token_ids)  # generation ends at any of these
        # Only the embedding, LM head and final norm hold weights (dflash.target.hf's
        # load_hf_head): the decoder is on the meta device and must never run.
        self.head_only = False
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        found = (self.embed_tokens.embedding_dim, len(layers), self.lm_head.out_features)
        stated = (geometry.hidden_size, geometry.num_layers, geometry.vocab_size)
        if found != stated:
            raise TargetError(
                f"target {spec}: (hidden size, layers, vocabulary) is {found} in the model "
                f"but {stated} in its config"
            )

    @property
    def hidden_size(self) -> int:
        return self.geometry.hidden_size

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers, first to last (on the meta device when `head_only`)."""
        return self._layers

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (and of the embedding)."""
        return self.geometry.vocab_size

    @property
    def max_positions(self) -> int | None:
        """The longest sequence a Hugging Face target was built for (None: no stated limit)."""
        if not self._is_hf:
            return None
        limit = getattr(text_config(self.model.config), "max_position_embeddings", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    def use_chat_template_kwargs(
        self, kwargs: Mapping[str, object], log: Callable[[str], None] | None = None
    ) -> None:
        """Every rendering of a conversation by this target's tokenizer gets `kwargs`
        (e.g. enable_thinking=False): training rows, regeneration and evaluation prompts
        alike. An argument given at a call still wins. `log` is told at start whether
        they are used (a target without a chat template renders conversations without)."""
        self.chat_template_kwargs = dict(kwargs)
        use_chat_template_kwargs(self.tokenizer, dict(kwargs))
        if log is None or not kwargs:
            return
        if getattr(self.tokenizer, "chat_template", None):
            log(f"chat template arguments: {json.dumps(kwargs, sort_keys=True)}")
        else:
            why = "no chat template (conversations are rendered as documented)"
            log(
                f"chat template arguments {json.dumps(kwargs)} unused: target {self.spec} has {why}"
            )

    def mask_token(self, explicit_id: int | None = None) -> MaskToken:
        """The mask row for a drafter of this target (see resolve_mask_token); with
        neither a mask token nor a spare row, the unused special token chosen from the
        data (`choose_mask_from_data`)."""
        try:
            return resolve_mask_token(self.tokenizer, self.embed_tokens.num_embeddings, explicit_id)
        except NoMaskToken:
            if self.data_mask_token is None:
                raise
            return self.data_mask_token

    def needs_mask_from_data(self, explicit_id: int | None) -> bool:
        try:
            resolve_mask_token(self.tokenizer, self.embed_tokens.num_embeddings, explicit_id)
        except NoMaskToken:
            return True
        return False

    def choose_mask_from_data(self, token_ids: Iterable[TokenArray]) -> MaskToken:
        """Picks the first special token none of `token_ids` holds (NoMaskToken if none)."""
        found = unused_special_token(self.tokenizer, self.embed_tokens.num_embeddings, token_ids)
        if found is None:
            resolve_mask_token(self.tokenizer, self.embed_tokens.num_embeddings)  # raises
        self.data_mask_token = found
        return found  # type: ignore[return-value]  # resolve_mask_token raised when found is None

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

    @property
    def is_hf(self) -> bool:
        """A transformers model (its own `generate`, padding, caches), not the tiny LM."""
        return self._is_hf

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
        # Any order and repeats: internal callers (a cache adding the last layer) may ask.
        check_layers_in_range(layer_ids, self.num_layers)
        wanted = sorted(set(layer_ids))
        kept: dict[int | str, Tensor] = {}
        last = wanted[-1]
        runs_to_norm = with_final_hidden and not with_logits

        def make_hook(i: int | str) -> Callable[..., None]:
            # Any: a layer's hidden states, alone or first in the tuple its model returns
            def hook(_module: nn.Module, _args: object, output: Any) -> None:
                kept[i] = output[0] if isinstance(output, tuple) else output
                if i == "norm" and runs_to_norm:
                    raise _StopForward
                if i == last and not (with_logits or with_final_hidden):
                    raise _StopForward

            return hook

        logits = None
        with self.forward_lock:
            handles = [self._layers[i].register_forward_hook(make_hook(i)) for i in wanted]
            if with_final_hidden:
                handles.append(self.final_norm().register_forward_hook(make_hook("norm")))
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

    # --- KV-cached decoding (evaluation, generation) ---

    def new_cache(self) -> Cache:
        """An empty KV cache for `forward_cached` (a DynamicCache for HF targets)."""
        if not self._is_hf:
            return KVCache()
        from transformers import DynamicCache

        return DynamicCache()

    @staticmethod
    def crop_cache(cache: Cache, length: int) -> None:
        """Forget every cached position from `length` on (after a rejected draft)."""
        if isinstance(cache, KVCache):
            cache.crop(length)
        else:
            crop_hf_cache(cache, length)

    @torch.no_grad()
    def forward_cached(
        self, input_ids: Tensor, cache: Cache, layer_ids: list[int] | None = None
    ) -> TargetOutput:
        """input_ids[B, L] continuing the cached positions; appends them to `cache`.

        -> logits[B, L, V] and, when layer_ids are given, hidden[B, L, K*D].
        """
        kept: dict[int, Tensor] = {}
        handles = []
        for i in sorted(set(layer_ids or [])):
            # Any: a layer's hidden states, alone or first in the tuple its model returns
            def hook(_m: nn.Module, _a: object, output: Any, i: int = i) -> None:
                kept[i] = output[0] if isinstance(output, tuple) else output

            handles.append(self._layers[i].register_forward_hook(hook))
        try:
            if self._is_hf:
                out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
                logits = out.logits
            else:
                logits = self.model(input_ids, cache=cache)
        finally:
            for handle in handles:
                handle.remove()
        hidden = torch.cat([kept[i] for i in layer_ids], dim=-1) if layer_ids else None
        # (mypy ignore below) hidden is None only with no layer_ids: logits alone
        return TargetOutput(hidden=hidden, logits=logits)  # type: ignore[arg-type]


def frozen_parts(target: TargetModel, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """The target's frozen embedding and LM head, on `device` (copied when elsewhere)."""
    embed, head = target.embed_tokens, target.lm_head
    if embed.weight.device == device:
        return embed, head
    return copy.deepcopy(embed).to(device), copy.deepcopy(head).to(device)


def target_fingerprint(target: TargetModel) -> str:
    """Hash of the target's architecture config and a probe of every weight tensor.

    The probe (a few values per tensor) tells differently trained weights apart
    without reading billions of parameters.
    """
    config = target.model.config
    fields = asdict(config) if is_dataclass(config) else config.to_dict()
    blob = json.dumps(fields, sort_keys=True, default=str)
    h = hashlib.sha256(f"{target.spec}\n{blob}".encode())
    for name, param in target.model.state_dict().items():
        probe = param.detach().reshape(-1)[:16].float().cpu()
        h.update(f"{name} {tuple(param.shape)} {param.dtype}".encode())
        h.update(probe.numpy().tobytes())
    return h.hexdigest()[:20]
