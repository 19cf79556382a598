"""`dflash-train`: the command line (click).

app      the command group and `main`
options  option types, options derived from the config tree, one-line errors
train    `train` and `prepare-target`
results  `eval`, `report` and `export`
data     `regenerate` and `cache-hidden`
"""

from dflash.cli.app import cli, main

__all__ = ["cli", "main"]
