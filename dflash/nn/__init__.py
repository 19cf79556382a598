"""Building blocks shared by the built-in tiny target and the drafter.

layers     RMSNorm, SwiGLU, rotary tables and head reshapes
rope       rotary parameters read from a target's config and written into a drafter's
kvcache    the per-layer key/value cache of cached decoding
schedule   the learning-rate schedule (linear warmup, then a cosine)
"""
