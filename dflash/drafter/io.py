"""The standard DFlash checkpoint directory: write, read, warm start, export.

Layout (docs/drafter-format.md is the spec): `config.json` (a Qwen3-style config
with `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and
`dflash_config`), `model.safetensors` (reference parameter names, training dtype),
and our own `dflash_train.json` beside them (target, training config, versions).
Serving engines and the authors' code read the first two and ignore the third.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash.drafter.model import DFlashDrafter, DrafterConfig, DrafterError
from dflash.errors import first_line
from dflash.files import replacing, write_json_atomic
from dflash.log import Log
from dflash.nn.rope import RopeError, RopeSpec, rope_from_config
from dflash.summary import JSON
from dflash.target import load as target_load  # by module: tests swap load_target
from dflash.target.model import TargetModel, last_layer_warning

ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE, WEIGHTS_FILE, METADATA_FILE = "config.json", "model.safetensors", "dflash_train.json"
FORMAT_VERSION = 1
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(cfg: DrafterConfig, dtype: torch.dtype = torch.float32) -> JSON:
    """config.json of a drafter: Qwen3 geometry + the DFlash fields the loaders read."""
    dtype_name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    config: JSON = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": cfg.max_position_embeddings,
        # Both rope layouts: transformers 5 reads rope_parameters, 4.x and engines rope_theta.
        "rope_theta": cfg.rope.theta,
        "rope_scaling": cfg.rope.rope_scaling(),
        "rope_parameters": cfg.rope.rope_parameters(),
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    }
    if cfg.pruned_vocab:  # vLLM sizes the drafter's own head and d2t by it
        config["draft_vocab_size"] = cfg.draft_vocab_size
    return config


def _require(data: JSON, key: str, where: Path) -> Any:  # Any: a JSON value, any type
    if key not in data or data[key] is None:
        raise DrafterError(f"{where} is not a DFlash drafter config: it has no {key!r}")
    return data[key]


def config_from_hf(data: JSON, where: Path, metadata: JSON) -> DrafterConfig:
    """DrafterConfig of a config.json (ours or a published DFlash drafter's)."""
    if ARCHITECTURE not in (data.get("architectures") or []):
        raise DrafterError(
            f"{where} is not a DFlash checkpoint: architectures is "
            f"{data.get('architectures')!r}, expected [{ARCHITECTURE!r}]"
        )
    dflash = _require(data, "dflash_config", where)
    heads = int(_require(data, "num_attention_heads", where))
    hidden = int(_require(data, "hidden_size", where))
    try:
        rope = rope_from_config(data)
        return DrafterConfig(
            hidden_size=hidden,
            num_layers=int(_require(data, "num_hidden_layers", where)),
            num_heads=heads,
            head_dim=int(data.get("head_dim") or hidden // heads),
            intermediate_size=int(_require(data, "intermediate_size", where)),
            block_size=int(dflash.get("block_size") or _require(data, "block_size", where)),
            target_layer_ids=[int(i) for i in _require(dflash, "target_layer_ids", where)],
            mask_token_id=int(_require(dflash, "mask_token_id", where)),
            vocab_size=int(_require(data, "vocab_size", where)),
            target_spec=str(metadata.get("target", "")),
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            rope=rope,
            rms_eps=float(data.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(data.get("attention_bias", False)),
            max_position_embeddings=int(data.get("max_position_embeddings") or 2048),
            num_target_layers=int(data.get("num_target_layers") or 0),
            mask_token_source=str(metadata.get("mask_token_source", "explicit")),
            draft_vocab_size=int(data.get("draft_vocab_size") or 0),
        )
    except (RopeError, TypeError, ValueError) as err:
        raise DrafterError(f"bad DFlash config {where}: {err}") from err


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("dflash-train", "transformers", "safetensors"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def save_drafter(
    drafter: DFlashDrafter,
    directory: Path | str,
    *,
    training_config: JSON | None = None,
    data_fingerprint: str | None = None,
    extra: JSON | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json, model.safetensors and dflash_train.json; each replaced atomically.
    `dtype`: the weights' (None: as trained)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or drafter.fc.weight.dtype
    # The d2t/t2d mappings of a draft vocabulary keep their integer and bool types.
    state = {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in drafter.state_dict().items()
    }
    with replacing(out / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    write_json_atomic(out / CONFIG_FILE, hf_config(drafter.config, dtype))
    meta = {
        "format_version": FORMAT_VERSION,
        "target": drafter.config.target_spec,
        "mask_token_id": drafter.config.mask_token_id,
        "mask_token_source": drafter.config.mask_token_source,
        "training_config": training_config,
        "data_fingerprint": data_fingerprint,
        "versions": _versions(),
        **(extra or {}),
    }
    write_json_atomic(out / METADATA_FILE, meta)
    return out


def pruned_head_note(cfg: DrafterConfig) -> str | None:
    """One line on how the engines serve a drafter with a draft vocabulary, else None."""
    if not cfg.pruned_vocab:
        return None
    return (
        f"drafter: its head proposes {cfg.draft_vocab_size} of the {cfg.vocab_size} tokens "
        "(--draft-vocab-size): vLLM serves it as saved; SGLang would ignore the pruned head "
        "(it drops lm_head.weight, d2t and t2d and drafts through the target's full head)"
    )


def read_drafter_config(directory: Path | str) -> DrafterConfig:
    """The DrafterConfig of a DFlash directory; one-line DrafterError when it is not one."""
    path = Path(directory)
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise DrafterError(
            f"{directory} is not a DFlash checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        data = json.loads(cfg_path.read_text())
        meta_path = path / METADATA_FILE
        metadata = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    except json.JSONDecodeError as err:
        raise DrafterError(f"{cfg_path} is not valid JSON: {err}") from err
    if "target_spec" in data and "architectures" not in data:
        raise DrafterError(
            f"{directory} is an older dflash-train drafter: convert it with "
            "`dflash-train export --drafter DIR --output NEW_DIR`"
        )
    return config_from_hf(data, cfg_path, metadata)


def check_fits_target(cfg: DrafterConfig, target: TargetModel, where: str) -> None:
    """One-line DrafterError naming both values when the drafter cannot run on `target`."""
    pairs = (
        ("hidden_size", cfg.hidden_size, target.hidden_size),
        ("num_target_layers", cfg.num_target_layers, target.num_layers),
        ("vocab_size", cfg.vocab_size, target.embed_tokens.num_embeddings),
    )
    for name, ours, theirs in pairs:
        if ours != theirs:
            raise DrafterError(
                f"{where}: drafter {name} is {ours}, the target {target.spec} has {theirs}"
            )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DrafterError(
            f"{where}: target_layer_ids {cfg.target_layer_ids} name layer {bad[0]}, "
            f"the target {target.spec} has {target.num_layers} layers"
        )


_MUST_MATCH = (  # the layers' shapes; the target layers and tokens they use; the rest
    *("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"),
    *("target_layer_ids", "num_target_layers", "vocab_size", "mask_token_id"),
    *("rope", "rms_eps", "attention_bias", "draft_vocab_size"),
)


# The flag that sets a field, for the ones a user chooses (the rest come from the target).
_FLAGS = {
    "num_layers": "--drafter-layers",
    "intermediate_size": "--drafter-intermediate-size",
    "target_layer_ids": "--target-layers",
    "mask_token_id": "--mask-token-id",
    "draft_vocab_size": "--draft-vocab-size",
}


def check_same_geometry(saved: DrafterConfig, fresh: DrafterConfig, where: str) -> None:
    """A warm start needs the checkpoint's geometry to equal the one built for this target."""
    for name in _MUST_MATCH:
        old, new = getattr(saved, name), getattr(fresh, name)
        if old != new:
            hint = f" (set {_FLAGS[name]})" if name in _FLAGS else ""
            raise DrafterError(
                f"--init-from {where}: checkpoint has {name}={old}, this run {new}{hint}"
            )


def _load_weights(drafter: DFlashDrafter, path: Path) -> None:
    try:
        state = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError) as err:
        raise DrafterError(f"{path / WEIGHTS_FILE} cannot be read: {err}") from err
    expected = drafter.state_dict()
    if set(state) != set(expected):
        diff = sorted(set(state) ^ set(expected))
        raise DrafterError(f"{path / WEIGHTS_FILE} does not match the drafter (e.g. {diff[0]!r})")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise DrafterError(
                f"{path / WEIGHTS_FILE}: {name} has shape {tuple(tensor.shape)}, "
                f"the drafter expects {tuple(expected[name].shape)}"
            )
    with torch.no_grad():
        for name, param in drafter.state_dict(keep_vars=True).items():
            param.copy_(state[name])


def init_drafter_from(drafter: DFlashDrafter, directory: Path | str) -> DrafterConfig:
    """Warm start: copy a DFlash checkpoint's weights into a freshly built drafter.

    Geometry, target layers and mask token must equal the fresh drafter's (one-line
    DrafterError naming both values otherwise). Returns the checkpoint's config.
    """
    saved = read_drafter_config(directory)
    check_same_geometry(saved, drafter.config, str(directory))
    _load_weights(drafter, Path(directory))
    return saved


def saved_chat_template_kwargs(directory: Path | str) -> JSON:
    """The --chat-template-kwargs the drafter was trained with ({} when none or unknown)."""
    try:
        meta = json.loads((Path(directory) / METADATA_FILE).read_text())
        text = (meta.get("training_config") or {}).get("target", {}).get("chat_template_kwargs")
        value = json.loads(text) if text else {}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def load_drafter(
    directory: Path | str,
    target: TargetModel | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[DFlashDrafter, TargetModel]:
    """A DFlash directory and its target (the one in dflash_train.json unless given)."""
    config = read_drafter_config(directory)
    if target is None:
        if not config.target_spec:
            raise DrafterError(f"{directory} names no target: pass the target explicitly")
        target = target_load.load_target(config.target_spec, device=device, dtype=dtype)
    check_fits_target(config, target, str(directory))
    drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head)
    _load_weights(drafter, Path(directory))
    return drafter.to(device=device, dtype=dtype).eval(), target


# --- export of the first dflash-train layout (config = DrafterConfig fields) ---

_OLD_NAMES = (  # old module path fragment -> reference name
    ("fc_norm.", "hidden_norm."),
    (".input_norm.", ".input_layernorm."),
    (".post_attn_norm.", ".post_attention_layernorm."),
    (".attn.", ".self_attn."),
)


def _renamed(name: str) -> str:
    for old, new in _OLD_NAMES:
        name = name.replace(old, new, 1)
    return name


def _target_num_layers(spec: str) -> int:
    return target_load.load_target(spec, device="cpu").num_layers


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)  # stdout is the command's answer (the new directory)


def export_drafter(
    old_dir: Path | str,
    new_dir: Path | str,
    *,
    num_target_layers: int | None = None,
    log: Log = _to_stderr,
) -> Path:
    """Convert a drafter saved by the first dflash-train layout into the DFlash format.

    num_target_layers None -> read from the old drafter's target (loaded on the CPU).
    `log` gets the warning when the drafter reads the target's last layer.
    """
    src, out = Path(old_dir), Path(new_dir)
    try:
        old = json.loads((src / CONFIG_FILE).read_text())
        state = load_file(str(src / WEIGHTS_FILE))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DrafterError(f"{old_dir} is not a dflash-train drafter: {first_line(err)}") from None
    except SafetensorError as err:
        raise DrafterError(
            f"{src / WEIGHTS_FILE} is damaged (truncated?): {first_line(err)}"
        ) from None
    if not isinstance(old, dict):
        raise DrafterError(f"{src / CONFIG_FILE} is not a drafter config (a JSON object)")
    if "architectures" in old:
        raise DrafterError(f"{old_dir} is already a DFlash checkpoint: nothing to export")
    if old.get("mask_token_id") is None or "mask_embedding" in state:
        raise DrafterError(
            f"{old_dir} uses a learned mask vector, which serving engines cannot embed: "
            "retrain it with a mask token id"
        )
    layers = num_target_layers or _target_num_layers(old["target_spec"])
    try:
        cfg = DrafterConfig(
            hidden_size=old["hidden_size"],
            num_layers=old["num_layers"],
            num_heads=old["num_heads"],
            head_dim=old["head_dim"],
            intermediate_size=old["intermediate_size"],
            block_size=old["block_size"],
            target_layer_ids=list(old["target_layer_ids"]),
            mask_token_id=old["mask_token_id"],
            vocab_size=old["vocab_size"],
            target_spec=old["target_spec"],
            num_kv_heads=old.get("num_kv_heads", 0),
            rope=RopeSpec(float(old.get("rope_theta", 10000.0))),
            rms_eps=old.get("rms_eps", 1e-6),
            num_target_layers=layers,
        )
    except KeyError as err:
        raise DrafterError(f"{src / CONFIG_FILE} lacks {err.args[0]!r}") from err
    except (TypeError, ValueError) as err:  # e.g. "target_layer_ids": null
        raise DrafterError(
            f"{src / CONFIG_FILE} has an unusable value: {first_line(err)}"
        ) from None
    renamed = {_renamed(k): v for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    with replacing(out / WEIGHTS_FILE) as tmp:
        save_file(renamed, str(tmp), metadata={"format": "pt"})
    dtype = next(iter(renamed.values())).dtype
    write_json_atomic(out / CONFIG_FILE, hf_config(cfg, dtype))
    meta = {
        "format_version": FORMAT_VERSION,
        "target": cfg.target_spec,
        "mask_token_id": cfg.mask_token_id,
        "mask_token_source": "exported",
        "exported_from": str(src),
        "versions": _versions(),
    }
    write_json_atomic(out / METADATA_FILE, meta)
    warning = last_layer_warning(cfg.target_layer_ids, layers)
    if warning is not None:
        log(warning)
    return out
