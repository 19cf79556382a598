"""The DFlash drafter: what is trained, and its saved format.

attention  block-sparse training attention (dense reference, grouped CPU path, flex)
model      `DrafterConfig` and `DFlashDrafter` (fusion + KV-injected block layers)
io         the standard DFlash directory: save, load, warm start, export
"""
