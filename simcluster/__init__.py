"""simcluster: a deterministic emulator of a GPU training cluster."""

__version__ = "0.1.0"
