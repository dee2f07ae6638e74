"""Architectures behind :mod:`linserve.model.interface`, one module each: ``linserve`` (the
project's own checkpoints)."""
