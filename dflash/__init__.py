"""DFlash drafter training: frozen target, block-diffusion drafter, losses, speculative evaluation."""

__version__ = "0.1.0"
