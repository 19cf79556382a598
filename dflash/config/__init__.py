"""Settings: one typed tree declared once, and what is derived from it.

schema     how a setting is declared, checked and shown (`setting`, `Option`, `Schema`)
settings   the sections and `TrainConfig`; flags, variables and config files come from it
commands   the sections of the other commands that no library component owns
checks     value checks that `setting(check=...)` names
devices    device names, this machine's devices and the rank's `Placement`

Naming: every section (a `Section`, whose fields are options) is `<What>Config`;
`TrainConfig` is the tree of `train`'s sections. The sections `eval` and `regenerate` /
`cache-hidden` read live beside their code (dflash.eval.config, dflash.offline.config), so
that a component owns what configures it; each setting is still declared once.
"""
