"""One drafter training step.

step          `DrafterTrainer`: the five phases of a step, gradient accumulation
optim         the pieces of an optimizer step: accumulation, the non-finite guard
step_metrics  figures read from the device on logged steps (metrics.jsonl)
"""
