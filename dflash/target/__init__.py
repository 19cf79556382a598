"""The frozen target: its geometry, the model wrapper, the kinds of target and decoding.

geometry   `TargetGeometry`, the one description of a target's shape, and its reader of
           Hugging Face configs (loading, `--dry-run` and the estimate use it)
model      `TargetModel`: hidden-state capture, cached forwards, the mask token
tiny       the built-in byte-level LM, trained once on the embedded corpus and cached
hf         Hugging Face causal LMs as targets
load       `load_target(spec)`: `builtin:tiny`, a local directory or a hub id
generation plain decoding with the target (the baseline, and regeneration)
synthetic  Qwen3-shaped targets with random weights, for benchmarks and checks
"""
