"""What `dflash-train eval` decodes and measures, declared once: the command's options
(flags, DFLASH_* variables, config-file keys, ranges) come from these sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash.config import checks
from dflash.config.schema import Section, setting
from dflash.config.settings import DataConfig, RunConfig
from dflash.target.decoding import check_decoding


@dataclass(frozen=True)
class EvalConfig(Section):
    """Prompts from chat JSONL (`eval_data`) or held-out windows of `data`, and how they
    are decoded. `data`, `num_prompts`, `prompt_tokens` and `seed` are the run's options
    (--data, --eval-prompts, --eval-prompt-tokens, --seed), handed over by the command."""

    eval_data: str | None = setting(
        None,
        "Chat JSONL of prompts ({'messages': [...]}, ShareGPT 'conversations' or "
        "{'turns': [...]}): each conversation up to its last user turn, through the chat "
        "template with the generation prompt; or a run's OUTPUT_DIR/eval_prompts.json, the "
        "token ids its τ was measured on. Without it, held-out windows of --data.",
        check=checks.existing_file,
    )
    # The same figure as the one a training run ends with (--eval-new-tokens): one default,
    # so `eval` on a run's drafter measures the τ of its summary.json.
    max_new_tokens: int = setting(
        RunConfig.eval_new_tokens,
        "Tokens generated at most per prompt; generation also ends at a stop token.",
        min=1,
    )
    temperature: float = setting(
        0.0,
        "Sampling temperature; 0 decodes greedily (output identical to the target's greedy "
        "decoding), above 0 uses the speculative-sampling acceptance rule.",
        min=0.0,
    )
    timing_repeats: int = setting(
        1,
        "Decode each prompt this often both ways and keep the fastest times (noisy machines).",
        min=1,
    )
    draft_sampling: Literal["greedy", "sample"] = setting(
        "greedy",
        "At --temperature > 0: greedy drafts accepted with probability p(x) (the DFlash "
        "authors' rule and vLLM's default), or drafts sampled from the drafter and accepted "
        "with min(1, p/q). Both keep the target's distribution; their τ differ.",
    )
    data: str = DataConfig.source
    num_prompts: int | None = RunConfig.eval_prompts  # None with eval_data: every conversation
    prompt_tokens: int = RunConfig.eval_prompt_tokens
    seed: int = RunConfig.seed

    def __post_init__(self) -> None:
        # The decoding rule every generator shares first, with its own error (GenerationError).
        check_decoding(self.max_new_tokens, self.temperature)
        super().__post_init__()


@dataclass(frozen=True)
class EvalJobConfig(Section):
    """Where `dflash-train eval` measures (a drafter here, a served engine, or both) and
    where its figures go."""

    drafter: str | None = setting(
        None,
        "Directory of a saved drafter (OUTPUT_DIR/drafter of a training run), evaluated in "
        "this process. Required unless --server is given; with --server both are measured.",
        check=checks.existing_folder,
    )
    concurrency: int = setting(
        1,
        "With --server: requests in flight at once; 1 also measures each prompt's τ, more "
        "gives the pooled τ alone.",
        min=1,
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "Dtype of the target and the drafter here; auto: bf16 on CUDA, fp32 elsewhere. Give "
        "the dtype the engine serves in to compare τ with it (a bf16 save is evaluated in "
        "fp32 under auto on a CPU).",
    )
    json: str | None = setting(
        None,
        "Also write the figures as JSON to this file (`-` for standard output).",
        check=checks.not_blank,
    )
