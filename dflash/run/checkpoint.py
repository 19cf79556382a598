"""Atomic checkpoints and exact resume.

A checkpoint is a directory `OUTPUT_DIR/checkpoints/step-<n>/` holding the
trainable drafter weights (safetensors: as the standard DFlash directory `drafter/`
when the caller writes one, which then serves as is), the trainer state (optimizer, schedule,
step, next batch index, RNG states; torch.save), the resolved config and a
manifest with a SHA-256 per file. It is written into a hidden temporary sibling,
fsynced, then renamed: a crash mid-write leaves only a `.tmp-*` directory that
loading ignores, never a `step-*` that loads wrong. The manifest is written last
and checked on load, so a damaged file is caught instead of silently resumed.

A sharded drafter (`--shard-drafter`) writes the same files: `gather_full_state`
collects its whole weights and AdamW state onto rank 0 (torch's public
`get_model_state_dict` / `get_optimizer_state_dict` with full_state_dict), so a
checkpoint does not depend on the world size that wrote it and resumes on any, sharded
or not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.optimizer import StateDict

from dflash.errors import DFlashError, first_line
from dflash.files import FILE_MODE, free_space_note, sha256_file
from dflash.summary import JSON

_STEP_DIR = re.compile(r"^step-(\d+)$")
_DRAFTER_WEIGHTS = "drafter/model.safetensors"  # a DFlash directory's weights
_WEIGHTS, _STATE, _CONFIG, _MANIFEST = (
    "drafter.safetensors",
    "trainer.pt",
    "config.json",
    "manifest.json",
)


class CheckpointError(DFlashError):
    """A checkpoint is missing or damaged; the message is one line naming the path."""


class SaveError(CheckpointError):
    """A save failed (a full disk, a folder gone read-only): one line naming the path,
    the space left there and what of the run is complete."""


SAVE_FAILURES = (OSError, RuntimeError, SafetensorError)
"""What a failed write raises: OSError, SafetensorError, or RuntimeError from torch.save,
whose zip writer reports a short write (a full disk) as "unexpected pos"."""


def save_failure(exc: BaseException, path: Path, complete: str) -> SaveError:
    """The SaveError of `exc` raised while writing `path`; `complete` says what remains."""
    free = free_space_note(path)
    reason = getattr(exc, "strerror", None) or first_line(exc)
    return SaveError(f"could not write {path} ({reason}; {free}): {complete}")


# torch's RNG states: the CPU generator's, and each CUDA device's where there are.
RngState = TypedDict(  # noqa: UP013 - a class body's key "torch" would hide the module
    "RngState", {"torch": torch.Tensor, "cuda": NotRequired[list[torch.Tensor]]}
)


@dataclass
class Checkpoint:
    """What a checkpoint restores."""

    path: Path
    weights: dict[str, torch.Tensor]  # trainable drafter parameters only
    trainer_state: StateDict  # DrafterTrainer.state_dict()
    step: int
    next_batch_index: int
    rng_state: RngState
    config: JSON


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def trainable_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (frozen embedding and LM head are the target's)."""
    return {
        name: p.detach().to("cpu").contiguous().clone()
        for name, p in module.named_parameters()
        if p.requires_grad
    }


def rng_state() -> RngState:
    state: RngState = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: RngState) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    checkpoints_dir: Path,
    *,
    weights: dict[str, torch.Tensor] | None = None,
    write_drafter: Callable[[Path], object] | None = None,
    trainer_state: StateDict,
    step: int,
    next_batch_index: int,
    config: JSON,
    keep: int = 3,
) -> Path:
    """Write `checkpoints_dir/step-<step>` atomically and keep the newest `keep`.

    The weights are either `weights` (drafter.safetensors) or what `write_drafter(dir)`
    writes into `dir` = the checkpoint's `drafter/` (a DFlash directory); exactly one.
    """
    if (weights is None) == (write_drafter is None):
        raise ValueError("save_checkpoint needs exactly one of weights and write_drafter")
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / f"step-{step:08d}"
    tmp = checkpoints_dir / f".tmp-step-{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_checkpoint(
            tmp, weights, write_drafter, trainer_state, step, next_batch_index, config
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise
    replace_dir(tmp, final)  # re-saving a step (resume, then save at once) replaces it
    _fsync_dir(checkpoints_dir)
    _prune(checkpoints_dir, keep)
    return final


def replace_dir(new: Path, final: Path) -> None:
    """Puts the complete directory `new` at `final`; an old `final` is moved aside first
    and removed last, so at every moment one complete directory is there or aside."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(new, final)
    shutil.rmtree(old, ignore_errors=True)


def _write_checkpoint(
    tmp: Path,
    weights: dict[str, torch.Tensor] | None,
    write_drafter: Callable[[Path], object] | None,
    trainer_state: StateDict,
    step: int,
    next_batch_index: int,
    config: JSON,
) -> None:
    if write_drafter is not None:
        write_drafter(tmp / "drafter")
    elif weights is not None:
        save_file(weights, str(tmp / _WEIGHTS))
        os.chmod(tmp / _WEIGHTS, FILE_MODE)
    else:
        raise ValueError("a checkpoint needs the drafter's weights or a function writing it")
    loop = {"step": step, "next_batch_index": next_batch_index, "rng": rng_state()}
    torch.save({"trainer": trainer_state, "loop": loop}, tmp / _STATE)
    (tmp / _CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    files = {name: sha256_file(tmp / name) for name in names}
    manifest = {"step": step, "written_ns": time.time_ns(), "sha256": files}
    (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2))
    for name in (*files, _MANIFEST):
        _fsync_file(tmp / name)
    for directory in {(tmp / name).parent for name in files}:
        _fsync_dir(directory)


def list_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete checkpoints, in the order they were written (temporary directories are
    ignored). Write order, not step order: a run resumed from an earlier checkpoint
    writes lower steps than the continuation it abandoned, and its own are the newest
    (`latest`), the ones pruning keeps."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=_write_order)


def checkpoint_step(path: Path) -> int:
    """The step of a `step-<n>` directory (by its name)."""
    match = _STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint folder (step-<n>)")
    return int(match.group(1))


def _write_order(path: Path) -> tuple[int, int]:
    step = checkpoint_step(path)
    try:
        written_ns = int(json.loads((path / _MANIFEST).read_text()).get("written_ns", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        written_ns = 0  # no readable manifest (older or damaged): by step, before the others
    return written_ns, step


def _prune(checkpoints_dir: Path, keep: int) -> None:
    for old in list_checkpoints(checkpoints_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in checkpoints_dir.glob(".tmp-step-*"):
        if stale.name.endswith(f"-{os.getpid()}"):
            continue
        shutil.rmtree(stale, ignore_errors=True)


def resolve_checkpoint(spec: str, output_dir: Path) -> Path:
    """`latest` -> newest in OUTPUT_DIR/checkpoints; a checkpoints folder -> its newest."""
    if spec == "latest":
        found = list_checkpoints(output_dir / "checkpoints")
        if not found:
            raise CheckpointError(f"--resume latest: no checkpoint in {output_dir / 'checkpoints'}")
        return found[-1]
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(f"--resume {spec!r}: no such checkpoint")
    if not (path / _MANIFEST).exists() and list_checkpoints(path):
        return list_checkpoints(path)[-1]
    if (path / "checkpoints").is_dir() and list_checkpoints(path / "checkpoints"):
        return list_checkpoints(path / "checkpoints")[-1]
    return path


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify a checkpoint; any damage is a one-line CheckpointError."""
    manifest_path = path / _MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt (manifest: {exc})"
        ) from exc
    for name, digest in expected.items():
        file = path / name
        if not file.is_file() or sha256_file(file) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} is missing or damaged")
    try:
        dflash_dir = (path / _DRAFTER_WEIGHTS).is_file()
        weights = load_file(str(path / (_DRAFTER_WEIGHTS if dflash_dir else _WEIGHTS)))
        state = torch.load(path / _STATE, map_location="cpu", weights_only=True)
        config = json.loads((path / _CONFIG).read_text())
        loop = state["loop"]
        return Checkpoint(
            path=path,
            weights=weights,
            trainer_state=state["trainer"],
            step=int(loop["step"]),
            next_batch_index=int(loop["next_batch_index"]),
            rng_state=loop["rng"],
            config=config,
        )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {exc}") from exc


def load_trainable_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable parameters into `module`; names must match exactly. The
    frozen tensors a checkpoint's drafter also holds (a draft vocabulary's head and
    d2t/t2d, rebuilt by this run from its data) must equal the module's own."""
    params = dict(module.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    frozen = {
        **dict(module.named_buffers()),
        **{n: p for n, p in params.items() if n not in trainable},
    }
    extra = set(weights) - trainable
    if not trainable <= set(weights) or not extra <= set(frozen):
        diff = sorted((set(weights) ^ trainable) - set(frozen))
        raise CheckpointError(f"checkpoint weights do not match the drafter (e.g. {diff[0]!r})")
    for name in sorted(extra):
        mine = frozen[name]
        if mine.shape != weights[name].shape or not torch.equal(
            mine.detach().cpu(), weights[name].to(mine.dtype)
        ):
            raise CheckpointError(
                f"checkpoint's {name!r} differs from this run's: the draft vocabulary (or the "
                "target's head) is not the one the checkpoint was trained with"
            )
    weights = {name: weights[name] for name in trainable}
    with torch.no_grad():
        for name, tensor in weights.items():
            if params[name].shape != tensor.shape:
                raise CheckpointError(
                    f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"drafter expects {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)


_FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def gather_full_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[StateDict, StateDict | None]:
    """(weights and buffers, optimizer state) of a sharded `module`, whole, on the host
    of rank 0 (other ranks get empty dicts). A collective: every rank calls it at the
    same step. The optimizer state is keyed by parameter name (torch's full form)."""
    weights = get_model_state_dict(module, options=_FULL_ON_RANK0)
    if optimizer is None:
        return weights, None
    return weights, get_optimizer_state_dict(module, optimizer, options=_FULL_ON_RANK0)


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateDict:
    """The optimizer state of an unsharded `module`, keyed by parameter name."""
    options = StateDictOptions(full_state_dict=True)
    return get_optimizer_state_dict(module, optimizer, options=options)


def load_full_optimizer_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: StateDict
) -> None:
    """Puts a name-keyed whole optimizer state into `optimizer` of `module`; a sharded
    module keeps its shard of every moment (each rank passes the whole state). torch
    creates the moments of an optimizer that has none by a step at lr 0, which counts
    in AdamW's bias correction until the loaded state replaces it: load only a state
    that holds moments."""
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(module, optimizer, state, options=options)
