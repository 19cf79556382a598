"""Settings: one typed tree declared once, and what is derived from it.

schema     how a setting is declared, checked and shown (`setting`, `Option`, `Schema`)
settings   the sections and `TrainConfig`; flags, variables and config files come from it
commands   the sections of the other commands that no library component owns
checks     value checks that `setting(check=...)` names
devices    device names, this machine's devices and the rank's `Placement`
"""
