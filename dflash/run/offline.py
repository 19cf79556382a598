"""The offline jobs of a run's config: `cache-hidden` and `regenerate`.

Both load the target as training would (device, dtype; `cache-hidden --samples-only`
its tokenizer, embedding and head alone) and then hand it to the formats of
dflash.offline; `cache-hidden` opens the target and cuts the batches with the code
`train` runs (dflash.run.build.open_target, dflash.run.rows.training_rows), so the
cache's batch i is the batch i of a run of the same config.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dflash.config.devices import (
    check_precision,
    decide_placement,
    precision_text,
    resolve_device,
)
from dflash.config.settings import TrainConfig
from dflash.data.chat import use_chat_template_kwargs
from dflash.data.corpus import EMBEDDED
from dflash.files import write_failure
from dflash.log import Log, say
from dflash.offline.config import BATCHES_PER_SHARD, RegenerateConfig, RegenerateError
from dflash.offline.hidden_cache import (
    WRITE_FAILURES,
    HiddenCacheError,
    open_hidden_cache,
    write_hidden_cache,
)
from dflash.offline.regenerate import RegenProgress, RegenReport, regenerate
from dflash.offline.sample_cache import SAMPLES_DIR, sample_files
from dflash.offline.sample_writer import write_sample_cache, write_sample_plan
from dflash.run.build import open_target
from dflash.run.rows import training_rows
from dflash.run.target_features import resolve_layer_ids
from dflash.summary import JSON
from dflash.target import load as target_load  # by module: tests swap load_target
from dflash.target.served import CompletionClient, ServerSettings, TokenizerTarget


def write_run_cache(
    cfg: TrainConfig,
    output_dir: Path | str,
    *,
    num_batches: int | None = None,
    batches_per_shard: int = BATCHES_PER_SHARD,
    fmt: str = "dflash",
    samples_only: bool = False,
    log: Log = say,
) -> str:
    """`dflash-train cache-hidden`: the features a `train` run of `cfg` would compute, for
    batches [0, num_batches) (None: --steps of one drafter device) in this project's
    batch cache, or (`fmt` speculators) for every document of the training rows, one
    file each in speculators' layout; `samples_only`: those documents and the manifest
    without their states, for an engine (vLLM) to extract. -> the line that says what
    was written."""
    device = decide_placement(cfg.pipeline).target
    dtype = target_load.target_dtype(device, cfg.pipeline.precision)
    # The files hold what the run's target dtype gives; for the samples alone the
    # decoder is needed only to regenerate --data embedded.
    whole = not samples_only or cfg.data.source == EMBEDDED
    on = device if whole else torch.device("cpu")
    # The live target's features, as a `train` run without --hidden-cache reads them; no
    # cast under `auto` on a CPU (run_precision): `train --hidden-cache` under auto reads
    # the states with its target as loaded, fp32 there.
    target = open_target(cfg, device, log, load_on=on, head_only=not whole)
    layer_ids = resolve_layer_ids(cfg, target.num_layers)
    log(f"precision: target in {str(dtype).removeprefix('torch.')}")
    train, heldout = training_rows(cfg, target, log)
    start_s = time.perf_counter()
    if samples_only:
        with _writes(output_dir):
            path = write_sample_plan(target, train, heldout, output_dir, layer_ids=layer_ids)
        with path.open() as lines:
            count = sum(1 for _ in lines)
        aux = [i + 1 for i in layer_ids]
        return (
            f"cache-hidden: {count} samples in {path}, their rows in the manifest; no hidden "
            f"states yet: an engine extracts aux_hidden_state_layer_ids {aux} and the last "
            f"layer in {str(dtype).removeprefix('torch.')} (tools/vllm/extract_hidden_states.py)"
        )
    if fmt == "speculators":
        # The last layer always follows, as speculators' vLLM generation writes it: its
        # trainer takes the last slice for the verifier's states whatever the run uses.

        def rows_done(done: int, of: int) -> None:
            rate = done * train.seq_len / max(time.perf_counter() - start_s, 1e-9)
            log(f"cache-hidden: {done}/{of} rows, {rate:,.0f} tokens/s")

        with _writes(output_dir):
            out = write_sample_cache(
                target,
                train,
                heldout,
                output_dir,
                layer_ids=layer_ids,
                with_last_layer=True,
                progress=rows_done,
            )
        files = sample_files(out)
        size = sum(p.stat().st_size for p in files.values())
        aux = [i + 1 for i in layer_ids]
        return (
            f"cache-hidden: {len(files)} samples ({size / 2**20:,.1f} MiB) in speculators' "
            f"layout in {out / SAMPLES_DIR}; aux_hidden_state_layer_ids {aux}"
        )
    total, soft = num_batches or cfg.run.steps, cfg.loss.use_soft_labels
    tokens_per_batch = train.batch_size * train.seq_len

    def progress(done: int, of: int) -> None:
        rate = done * tokens_per_batch / max(time.perf_counter() - start_s, 1e-9)
        log(f"cache-hidden: {done}/{of} batches, {rate:,.0f} tokens/s")

    write_hidden_cache(
        target,
        train,
        output_dir,
        layer_ids=layer_ids,
        num_batches=total,
        with_final_norm=soft,  # what the cache holds, with layer_ids
        batches_per_shard=batches_per_shard,
        progress=progress,
        log=log,
    )
    reader = open_hidden_cache(
        output_dir, target=target, dataset=train, layer_ids=layer_ids, with_final_norm=soft
    )
    tokens = reader.num_batches * reader.dataset.batch_size * reader.dataset.seq_len
    amount = f"{tokens:,} tokens, {reader.total_bytes / 2**20:,.1f} MiB"
    return f"cache-hidden: {reader.num_batches} batches ({amount}) in {output_dir}"


@contextmanager
def _writes(output_dir: Path | str) -> Iterator[None]:
    """A write of speculators' layout that fails (a full disk) is one line, as train's
    at a checkpoint; the samples written are kept, and a rerun writes them all again."""
    try:
        yield
    except WRITE_FAILURES as exc:
        where = getattr(exc, "filename", None) or output_dir
        raise HiddenCacheError(
            f"{write_failure(exc, where)}: --output {output_dir} is incomplete; run the same "
            "command again once there is room"
        ) from None


def regenerate_data(
    target_spec: str,
    device: str,
    source: str,
    output: Path | str,
    settings: RegenerateConfig,
    *,
    progress: Callable[[RegenProgress], None] | None = None,
    log: Log = say,
    chat_template_kwargs: JSON | None = None,
    server: ServerSettings | None = None,
    precision: str = "auto",
) -> RegenReport:
    """`dflash-train regenerate`: the target on `device` (`auto`: cuda:0 when present) in
    --precision `precision` rewrites `source` into `output` with its own replies; with
    `server`, the server's replies, and only the target's tokenizer loads here."""
    if server is not None:
        tokenizer = target_load.load_tokenizer(target_spec)
        use_chat_template_kwargs(tokenizer, chat_template_kwargs or {})
        served = TokenizerTarget(target_spec, tokenizer, dict(chat_template_kwargs or {}))
        client = CompletionClient(server)
        client.connect(served, log)
        return regenerate(
            served, source, output, settings=settings, progress=progress, server=client
        )
    dev = resolve_device(device, "--device")
    check_precision(precision, [dev])  # before the target loads
    dtype = target_load.target_dtype(dev, precision)
    target = target_load.load_target(target_spec, dev, dtype, log=log)
    target_load.run_precision(target, precision, dev)
    outside = [i for i in settings.stop_token_ids if not 0 <= i < target.vocab_size]
    if outside:  # such an id never comes: every reply would run to --max-new-tokens
        raise RegenerateError(
            f"--stop-token-ids {','.join(map(str, outside))}: not in the vocabulary of target "
            f"{target_spec} (ids 0..{target.vocab_size - 1})"
        )
    log(precision_text(precision, dev, target.hidden_size))  # once the flags are good
    target.use_chat_template_kwargs(chat_template_kwargs or {}, log)
    return regenerate(target, source, output, settings=settings, progress=progress)
