"""Architectures behind :mod:`model.interface`, one module each: ``linserve`` (the project's own
checkpoints)."""
