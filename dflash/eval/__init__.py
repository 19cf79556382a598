"""Speculative decoding with a drafter and its acceptance length τ.

speculative  draft, verify, accept (exactly the target's greedy output at temperature 0)
prompts      evaluation prompts from chat JSONL
evaluate     τ and the speedup over prompts; the entry points of `train` and `eval`
"""
