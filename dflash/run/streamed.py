"""`train --target-engine vllm`: the target stage as a vLLM engine, its hidden states
streamed into training through a bounded spool (dflash.offline.spool, the protocol).

The run's rows are the online run's. Once the batches the run reads are known, their
samples (each document with a position to learn, dflash.offline.sample_writer's
document_segments, as `cache-hidden --samples-only` cuts them) are written in the order
training reads them to OUTPUT_DIR/vllm-samples.jsonl, and
tools/vllm/extract_hidden_states.py --spool-size runs over them in a process group of its
own (its output in OUTPUT_DIR/vllm-extract.log). The reader takes each sample's file from
the spool, places it in its row, and deletes it. Whatever ends the run ends the group
(SIGTERM, then SIGKILL), at the latest when the interpreter exits.

Under torchrun every rank does all of this over its own batches (every world_size-th,
dflash.pipeline.distributed's rule), with an engine of its own, on its target devices,
in SPOOL/rank-{r:05d}, its plan and log named after its rank (`rank_files`).
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

import tracing
from dflash import names
from dflash.config.settings import TrainConfig
from dflash.data.datasets import Batch, PackedDataset
from dflash.offline.sample_file import DTYPES, HIDDEN, SampleFile, dtype_name
from dflash.offline.sample_writer import document_segments
from dflash.offline.spool import Spool, SpoolError, sample_bytes
from dflash.run.estimate import EstimateError, geometry_for_spec
from dflash.target.model import TargetModel, TargetOutput, choose_target_layers

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "vllm" / "extract_hidden_states.py"
LOG_NAME = "vllm-extract.log"
SAMPLES_NAME = "vllm-samples.jsonl"
STOP_GRACE_S = 10.0
LOG_TAIL_BYTES = 64 * 1024  # where the script's last line is, past vLLM's own output
# What torchrun tells its workers (and TORCHELASTIC_*); the engine is no worker of the
# run's process group, and vLLM reads some of these (LOCAL_RANK picks a worker's device
# in its own visible ones; RANK and WORLD_SIZE its external launcher's).
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def rank_and_world() -> tuple[int, int]:
    """(this rank, the number of ranks) of the run's process group; (0, 1) without one
    (one process, or the reference loop, which never joins one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_files(output_dir: Path, rank: int, world_size: int) -> tuple[Path, Path]:
    """(plan, engine log) of this rank in OUTPUT_DIR: every rank writes its own beside
    the others' (ranks share --output-dir); one process keeps the plain names."""
    if world_size == 1:
        return output_dir / SAMPLES_NAME, output_dir / LOG_NAME
    tag = f".rank-{rank:05d}"
    plan = SAMPLES_NAME.removesuffix(".jsonl") + tag + ".jsonl"
    return output_dir / plan, output_dir / (LOG_NAME.removesuffix(".log") + tag + ".log")


def engine_env(
    targets: Sequence[torch.device], env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The engine's environment: the run's without torchrun's variables, and with CUDA
    targets, CUDA_VISIBLE_DEVICES naming them (through the run's own
    CUDA_VISIBLE_DEVICES): the engine runs where the target would have run, this rank's
    slice of the node's GPUs (--target-devices picks them)."""
    out = {k: v for k, v in (os.environ if env is None else env).items()}
    for name in [*TORCHRUN_ENV, *(k for k in out if k.startswith("TORCHELASTIC_"))]:
        out.pop(name, None)
    cuda = [d.index or 0 for d in targets if d.type == "cuda"]
    if cuda:
        seen = out.get("CUDA_VISIBLE_DEVICES")
        visible = [v.strip() for v in seen.split(",")] if seen else None
        names = [visible[i] if visible and i < len(visible) else str(i) for i in cuda]
        out["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(names))
    return out


def check_vllm_python(python: str | None) -> None:
    """A python that imports vLLM, or one line naming it."""
    if python is None:
        raise SpoolError("--target-engine vllm needs --vllm-python: the python that has vLLM")
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') else 3)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SpoolError(f"--vllm-python {python} does not run ({err})") from None
    if done.returncode != 0:
        raise SpoolError(f"--vllm-python {python} has no vLLM (it cannot import vllm)")


def smallest_sample_bytes(cfg: TrainConfig) -> int | None:
    """The bytes of one sample of --seq-len tokens, from the target's config (None: its
    geometry is unknown here), in the narrowest dtype it may run in."""
    try:
        geometry, _ = geometry_for_spec(cfg.target.spec)
    except EstimateError:
        return None
    layers = len(
        choose_target_layers(cfg.target.layer_ids, geometry.num_layers, cfg.drafter.num_layers)
    )
    itemsize = 4 if cfg.pipeline.precision == "fp32" else 2
    return sample_bytes(cfg.data.seq_len, layers + 1, geometry.hidden_size, itemsize)


class Engine:
    """The extraction script's process group; `stop` ends it, once."""

    def __init__(
        self, command: list[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=None if env is None else dict(env),
            )
        self._lock = threading.Lock()
        atexit.register(self.stop)

    def error(self) -> str | None:
        """Why the engine will write nothing more, or None while it runs (or ended well):
        the script's own `Error:` line when it wrote one (a target vLLM cannot load, a
        full disk), which the log's thousands of lines would otherwise bury."""
        code = self.process.poll()
        if code is None or code == 0:
            return None
        said = self.last_error()
        why = f" ({said})" if said else ""
        return f"the vLLM engine exited with code {code}{why}: see {self.log_path}"

    def last_error(self) -> str | None:
        """The last `Error: ...` line of the engine's log, without its prefix."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                tail = log.read().decode("utf-8", "replace")
        except OSError:
            return None
        said = [line for line in tail.splitlines() if line.startswith("Error: ")]
        return said[-1].removeprefix("Error: ").strip() if said else None

    def ended(self) -> bool:
        return self.process.poll() is not None

    def stop(self) -> None:
        with self._lock:
            group = self.process.pid
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            try:  # vLLM's engine-core and workers share the group
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


class SpoolReader:
    """The target stage of a streamed run: batch i's features from the spool's files, the
    n-th file the n-th sample the run reads, each deleted once read.

    Thread contract: one target thread calls `read`, batches in order."""

    def __init__(
        self,
        spool: Spool,
        engine: Engine | None,
        order: dict[int, list[list[tuple[int, int, int]]]],
        dataset: PackedDataset,
        k: int,
        width: int,
        dtype: torch.dtype,
        norm: torch.nn.Module | None,
    ) -> None:
        self.spool, self.engine, self.order, self.dataset = spool, engine, order, dataset
        self.k, self.width, self.dtype, self.norm = k, width, dtype, norm
        self.bytes_read = 0
        self.samples_read = 0

    def _engine_error(self) -> str | None:
        if self.engine is None:
            return None
        why = self.engine.error()
        if why is None and self.engine.ended():
            return f"the vLLM engine ended before writing every sample: see {self.engine.log_path}"
        return why

    def read(self, batch: Batch) -> TargetOutput:
        places = self.order[batch.batch_id]
        b, t = batch.input_ids.shape
        hidden = torch.zeros(b, t, self.k * self.width, dtype=self.dtype)
        final = torch.zeros(b, t, self.width, dtype=self.dtype) if self.norm else None
        for r, segments in enumerate(places):
            for n, start, length in segments:
                path = self.spool.wait(n, self._engine_error)
                sample = SampleFile(path, self.width)
                got = (sample.length, sample.layers, sample.width)
                want = (length, self.k + 1, self.width)
                if not sample.stacked or got != want or DTYPES.get(sample.dtype) != self.dtype:
                    raise SpoolError(
                        f"spool sample {path}: hidden states {list(got)} "
                        f"{dtype_name(sample.dtype)}, the run needs {list(want)} {self.dtype}"
                    )
                (hs,) = sample.read(HIDDEN)
                engine_span(sample, n)
                self.spool.remove(path)
                span = slice(start, start + length)
                hidden[r, span].view(length, self.k, -1).copy_(hs[:, : self.k])
                if final is not None:
                    final[r, span].copy_(hs[:, self.k])
                self.bytes_read += sample.nbytes(HIDDEN)
                self.samples_read += 1
        if final is not None and self.norm is not None:
            with torch.no_grad():
                final = self.norm(final.to(next(self.norm.parameters()).device)).to(final.dtype)
        return TargetOutput(hidden=hidden, logits=None, final_hidden=final)


def engine_span(sample: SampleFile, n: int) -> None:
    """The engine's side of sample `n` in the reading batch's trace: a span from its
    vLLM call (queued) to its file written (the file's mtime), an event when vLLM had
    extracted it; a child of the reader's phase, so that the engine and the training
    run share one timeline. Nothing without an open traced phase or the engine's times."""
    parent = tracing.current_phase()
    times = sample.metadata
    try:
        queued = int(times["dflash.engine.queued_ns"])
        extracted = int(times["dflash.engine.extracted_ns"])
        written = sample.path.stat().st_mtime_ns
    except (KeyError, ValueError, OSError):
        return
    if parent is None:
        return
    span = tracing.start_span(
        names.ENGINE_SAMPLE,
        {names.SAMPLE_INDEX: n},
        parent=parent,
        start_time_ns=queued,
        level="phase",
    )
    if span.span is not None:
        span.span.add_event("extracted", timestamp=extracted)
    span.end(max(written, queued))


Order = dict[int, list[list[tuple[int, int, int]]]]


def rank_batches(first: int, last: int, rank: int, world_size: int) -> range:
    """The batches `rank` reads, in order, of a run whose next batch is `first` and
    whose rank's last is `last`: every world_size-th from first + rank, as
    dflash.pipeline.distributed.rank_batch_indices hands them out."""
    return range(first + rank, last + 1, world_size)


def stream_plan(
    dataset: PackedDataset, first: int, last: int, rank: int = 0, world_size: int = 1
) -> tuple[Order, list[str]]:
    """Per batch `rank` reads (`rank_batches`), per row, its samples (n, start, length),
    n counting the samples in the order training reads them; and samples.jsonl's lines
    for them.

    Each line names its batch, its place in it and its row (the engine ignores them;
    a row may come twice in one batch where epochs meet): a resumed run's plan starts at
    the batch its checkpoint needs next, and the two plans side by side show which rows
    each run read."""
    order: Order = {}
    lines: list[str] = []
    for index in rank_batches(first, last, rank, world_size):
        order[index] = []
        for slot, row in enumerate(dataset.row_indices(index)):
            segments = []
            for start, length in document_segments(dataset, int(row)):
                ids = dataset.ids[row, start : start + length].astype("int64").tolist()
                mask = dataset.mask[row, start : start + length].astype(int).tolist()
                n = len(lines)
                line = {"index": n, "batch": index, "slot": slot, "row": int(row)}
                line["start"] = start
                lines.append(json.dumps({**line, "token_ids": ids, "loss_mask": mask}))
                segments.append((n, start, length))
            order[index].append(segments)
    return order, lines


def engine_command(
    cfg: TrainConfig, target: TargetModel, layer_ids: list[int], plan: Path, spool: Path, bound: int
) -> list[str]:
    """The extraction script over `plan`, into `spool`, in the target's dtype."""
    dtype = str(target.embed_tokens.weight.dtype).removeprefix("torch.")
    command = [
        str(cfg.target.vllm_python),
        str(SCRIPT),
        "--target",
        target.spec,
        "--samples",
        str(plan),
        "--output",
        str(spool),
        "--target-layers",
        ",".join(str(i) for i in layer_ids),
        "--dtype",
        dtype,
        "--spool-size",
        str(bound),
    ]
    if cfg.target.engine_args:
        command += ["--", *shlex.split(cfg.target.engine_args)]
    return command
