"""What `dflash-train eval` decodes, declared once (the command's defaults come from it)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config.settings import DataConfig, RunConfig
from dflash.target.decoding import check_decoding


@dataclass(frozen=True)
class EvalSettings:
    """Prompts from chat JSONL (`eval_data`) or held-out windows of `data`, and how they
    are decoded."""

    data: str = DataConfig.source
    eval_data: str | None = None
    num_prompts: int | None = RunConfig.eval_prompts  # None with eval_data: every conversation
    prompt_tokens: int = RunConfig.eval_prompt_tokens
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = RunConfig.seed
    timing_repeats: int = 1
    draft_sampling: str = "greedy"
    """At temperature > 0: `greedy` drafts (accepted with probability p(x): the authors'
    rule and vLLM's default) or `sample`d drafts (accepted with min(1, p/q))."""

    def __post_init__(self) -> None:
        check_decoding(self.max_new_tokens, self.temperature)
