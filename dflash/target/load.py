"""`load_target(spec)`: the kinds of target behind one `TargetModel`.

`builtin:tiny` is the project's own byte-level LM (its weights ship in the repository); anything
else is a local Hugging Face directory or a hub id (dflash.target.hf). Callers reach
`load_target` through this module (`target_load.load_target`), the seam tests replace.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dflash.config.devices import resolve_precision
from dflash.data.tokenizer import ByteTokenizer, Tokenizer, encode_texts
from dflash.errors import first_line
from dflash.target.geometry import TargetError
from dflash.target.hf import (
    PROBE_TEXT,
    can_load_head_only,
    check_not_a_drafter,
    check_tokenizer,
    hub_unreachable,
    load_hf_head,
    load_hf_target,
)
from dflash.target.model import TargetModel
from dflash.target.tiny import TinyLM, load_tiny_lm, prepare_builtin_target

BUILTIN_PREFIX = "builtin:"
BUILTIN_NAMES = ("tiny",)


def target_dtype(device: torch.device, precision: str | None = None) -> torch.dtype:
    """The dtype a frozen target loads in. `precision`: the run's --precision
    (dflash.config.devices.resolve_precision): bf16 where it resolves to bf16 on `device`
    before the target's width is known (CUDA under `auto`, `bf16`), else fp32, which
    `run_precision` may turn to bf16 once the target is loaded; None (the commands
    without --precision): bf16 on CUDA, fp32 elsewhere."""
    if precision is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if resolve_precision(precision, device) == "bf16" else torch.float32


def run_precision(target: TargetModel, precision: str, device: torch.device) -> TargetModel:
    """The loaded target in the dtype --precision gives on `device` for its hidden size:
    under `auto` on a CPU with native bf16 a target wide enough for bf16 to pay is cast to
    bf16 here (it loaded in fp32: its width was not known before). Its hidden states, the
    embedding and LM head the drafter shares are then bf16, as on CUDA. For a target that
    computes (training online, regenerating): a hidden cache's states were written in the
    dtype the target loads in, and are read with it."""
    wanted = resolve_precision(precision, device, target.hidden_size)
    if wanted == "bf16" and target.embed_tokens.weight.dtype == torch.float32:
        # The weights only: buffers such as RoPE's inverse frequencies stay fp32, as a
        # Hugging Face model loaded in bf16 keeps them.
        for param in target.parameters():
            if param.is_floating_point():
                param.data = param.data.to(torch.bfloat16)
    return target


def wrap_tiny(model: TinyLM, spec: str = "builtin:tiny") -> TargetModel:
    """A TargetModel around a TinyLM (also used by tests with untrained weights)."""
    tokenizer = ByteTokenizer()
    return TargetModel(
        model,
        model.layers,
        spec=spec,
        tokenizer=tokenizer,
        geometry=model.config.geometry(),
        stop_token_ids=(tokenizer.eos_token_id,),
    )


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


def load_target(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    log: Callable[[str], None] = print,
    head_only: bool = False,
) -> TargetModel:
    """`builtin:tiny` (the shipped weights), a local HF directory or a hub id.
    `head_only`: a local HF directory's embedding, LM head and final norm alone, on the
    CPU (`load_hf_head`); other targets load whole."""
    if head_only and can_load_head_only(spec):
        return load_hf_head(spec, dtype)  # its decoder never runs: nothing to check
    if spec.startswith(BUILTIN_PREFIX):
        target = _builtin_target(spec[len(BUILTIN_PREFIX) :], device, dtype, log)
    else:
        target = load_hf_target(spec, device, dtype)
    check_finite_states(target)
    return target


@torch.no_grad()
def check_finite_states(target: TargetModel) -> None:
    """One forward of a short text before any work: a target whose weights hold NaN or
    inf computes non-finite hidden states, on which training skips every step (and saves
    an untrained drafter) and regeneration writes noise. One line naming the target, the
    first layer whose states are not finite and the weights that are not."""
    ids = encode_texts(target.tokenizer, [PROBE_TEXT])[0].tolist()[:16]
    bos = getattr(target.tokenizer, "bos_token_id", None)
    ids = ([bos] if isinstance(bos, int) else []) + ids
    if not ids:
        return
    layers = list(range(target.num_layers))
    out = target.capture(torch.tensor([ids], device=target.device), layers, with_logits=True)
    states = out.hidden.reshape(len(ids), target.num_layers, -1)  # [T, layers, D]
    finite = torch.isfinite(states).all(dim=-1).all(dim=0)  # [layers]
    logits_finite = out.logits is None or bool(torch.isfinite(out.logits).all())
    if bool(finite.all()) and logits_finite:
        return
    bad = [name for name, p in target.named_parameters() if not bool(torch.isfinite(p).all())]
    where = (
        f"its hidden states are NaN or inf from layer {int((~finite).nonzero()[0]) + 1} of "
        f"{target.num_layers} on"
        if not bool(finite.all())
        else "its logits are NaN or inf on"
    )
    weights = ""
    if bad:
        shown = ", ".join(n.removeprefix("model.") for n in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        weights = f"; {len(bad)} weight tensors hold NaN or inf ({shown}{more})"
    raise TargetError(
        f"target {target.spec}: {where} a {len(ids)}-token probe{weights}: its weights are "
        "damaged, and a drafter learns nothing from them"
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of a target without its weights (builtin:tiny: the byte tokenizer)."""
    if spec.startswith(BUILTIN_PREFIX):
        return ByteTokenizer()
    try:
        from transformers import AutoTokenizer  # with the target: an optional dependency
    except ImportError as err:
        raise TargetError(
            "Hugging Face targets need transformers: pip install 'dflash-train[hf]'"
        ) from err
    path = Path(spec).expanduser()
    check_not_a_drafter(spec)
    # A hub that cannot answer is not waited for: the Hugging Face cache answers instead.
    cached_only = not path.exists() and hub_unreachable() is not None
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path) if path.exists() else spec, local_files_only=cached_only
        )
    except (OSError, ValueError, KeyError) as err:
        why = first_line(err)
        raise TargetError(f"cannot load the tokenizer of target {spec}: {why}") from None
    check_tokenizer(spec, tokenizer)
    return tokenizer


def prepare_target_spec(spec: str, log: Callable[[str], None] = print) -> Path | str:
    """`dflash-train prepare-target`: check builtin:tiny's shipped weights, or load a HF
    target once."""
    if spec == "builtin:tiny":
        return prepare_builtin_target(log=log)  # the shipped directory `train` loads
    target = load_target(spec, torch.device("cpu"), torch.float32)
    log(f"target {spec}: {target.num_layers} layers, hidden size {target.hidden_size}")
    return spec
