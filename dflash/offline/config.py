"""The settings of the offline jobs, declared once: the commands' options (flags,
DFLASH_* variables, config-file keys, ranges) come from these sections.

Light on purpose (no torch): the command line reads it to build its options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash.config import checks
from dflash.config.schema import Section, setting
from dflash.config.settings import DataConfig, RunConfig
from dflash.data.sources import DataError

# Batches per shard file of a hidden-state cache (the resume granularity).
BATCHES_PER_SHARD = 64


class RegenerateError(DataError):
    """Regeneration cannot start or continue; one line naming the file or value."""


@dataclass(frozen=True)
class RegenerateConfig(Section):
    """How `regenerate` decodes. Every field is in the run record of its output (a
    file of other settings is not continued), so the fields stay as they are. `seed` and
    `heldout_fraction` are the run's options (--seed, --heldout-fraction), handed over by
    the command."""

    max_new_tokens: int = setting(
        128, "Tokens generated at most per assistant turn or text window.", min=1
    )
    temperature: float = setting(0.0, "Sampling temperature; 0 decodes greedily.", min=0.0)
    stop_token_ids: tuple[int, ...] = setting(
        (),
        "Comma-separated token ids that end a reply; unset: the target's EOS ids.",
        check=checks.token_ids,
    )
    prefix_tokens: int = setting(
        64, "Plain text: tokens of corpus text kept as each window's prompt.", min=1
    )
    windows_per_document: int | None = setting(
        None,
        "Plain text: at most this many windows per document, spread evenly; unset: all.",
        min=1,
    )
    batch_size: int = setting(16, "Prompts of one length decoded together (one KV cache).", min=1)
    chunk_lines: int = setting(
        64, "Lines regenerated and written together: the resume granularity.", min=1
    )
    seed: int = RunConfig.seed
    heldout_fraction: float = DataConfig.heldout_fraction


@dataclass(frozen=True)
class RegenerateJobConfig(Section):
    """Where `regenerate` writes, and how many requests a server gets at once."""

    output: str = setting(
        None,
        "JSONL written in the input's shape, one line per conversation or window. An "
        "interrupted run continues it; a file of another run is refused, never overwritten.",
        check=checks.not_blank,
    )
    concurrency: int = setting(8, "With --server: requests in flight at once.", min=1)


@dataclass(frozen=True)
class CacheHiddenConfig(Section):
    """`cache-hidden`: the target run once over the training batches of a run's options."""

    output: str = setting(
        None,
        "Cache directory (sharded safetensors + index.json); an interrupted cache continues.",
        check=checks.not_blank,
    )
    num_batches: int | None = setting(
        None,
        "Batches to cache; unset: --steps (one drafter device on one rank; N devices or "
        "ranks read N times as many).",
        min=1,
    )
    batches_per_shard: int = setting(
        BATCHES_PER_SHARD, "Batches per shard file (the resume granularity).", min=1
    )
    format: Literal["dflash", "speculators"] = setting(
        "dflash",
        "dflash: batches of the run, for this project's trainer; speculators: one "
        "hs_{i}.safetensors file per document of the training rows in "
        "vllm-project/speculators' layout (auxiliary layers, then the last layer with "
        "--use-soft-labels), which either tool trains from (--num-batches and "
        "--batches-per-shard do not apply).",
    )
    samples_only: bool = setting(
        False,
        "With --format speculators: write the documents (OUTPUT/samples.jsonl, "
        "dflash_samples.json and the Arrow dataset) without their hidden states, loading only "
        "the target's tokenizer, embedding and head, for vLLM to extract the states "
        "(tools/vllm/extract_hidden_states.py).",
    )
