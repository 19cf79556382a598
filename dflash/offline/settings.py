"""The settings of the offline jobs, declared once: the commands' defaults come from here.

Light on purpose (no torch): the command line reads it to build its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config.settings import DataConfig, RunConfig
from dflash.data.sources import DataError

# Batches per shard file of a hidden-state cache (the resume granularity).
BATCHES_PER_SHARD = 64


class RegenerateError(DataError):
    """Regeneration cannot start or continue; one line naming the file or value."""


@dataclass(frozen=True)
class RegenerateSettings:
    max_new_tokens: int = 128
    """Tokens generated per assistant turn or text window (`--max-new-tokens`)."""
    temperature: float = 0.0
    """0 decodes greedily; above 0 samples (`--temperature`)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a reply; empty takes the target's EOS ids (`--stop-token-ids`)."""
    prefix_tokens: int = 64
    """Plain text: tokens of corpus text kept as each window's prompt (`--prefix-tokens`)."""
    windows_per_document: int | None = None
    """Plain text: at most this many windows per document, spread evenly; None = all."""
    batch_size: int = 16
    """Prompts of one length decoded together."""
    chunk_lines: int = 64
    """Output lines regenerated and written together (the resume granularity)."""
    seed: int = RunConfig.seed
    """Seed of sampling (unused when greedy)."""
    heldout_fraction: float = DataConfig.heldout_fraction
    """Documents held out of training (same split as `train`); they are not regenerated."""

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "prefix_tokens", "batch_size", "chunk_lines"):
            if getattr(self, name) < 1:
                raise RegenerateError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1"
                )
        if self.temperature < 0:
            raise RegenerateError(f"--temperature {self.temperature} must be >= 0")
