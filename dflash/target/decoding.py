"""The decoding settings every generator shares, checked without loading a model."""

from __future__ import annotations

from dflash.errors import DFlashError


class GenerationError(DFlashError):
    """A decoding setting out of range; the message names the flag."""


def check_decoding(max_new_tokens: int, temperature: float) -> None:
    """One-line errors for the decoding flags shared by eval and generation."""
    if max_new_tokens <= 0:
        raise GenerationError(f"--max-new-tokens {max_new_tokens} must be > 0")
    if temperature < 0:
        raise GenerationError(f"--temperature {temperature} must be >= 0 (0 = greedy)")
