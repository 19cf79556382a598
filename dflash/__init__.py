"""dflash-train: train DFlash block-diffusion drafters with every phase traced."""

__version__ = "0.1.0"
