"""The process-wide modes the loader sets before a model is built: batch invariance
(``--batch-invariant``, on by default: :mod:`linserve.model.invariant`) and the quantization of
GEMM weights as they are packed (``--quantization``: :mod:`linserve.model.packing`)."""

from __future__ import annotations

import torch

from linserve.model import kernels, quantize

_enabled = [True]


_quantization = ["none"]


def set_enabled(on: bool) -> None:
    """Turn the mode on or off for this process (eager forms and, once loaded, kernels)."""
    _enabled[0] = on
    if kernels.load():
        torch.ops.linserve.set_batch_invariant(on)


def enabled() -> bool:
    """Whether the mode is on (what was asked, whether or not the kernels could load)."""
    return _enabled[0]


def set_quantization(mode: str) -> None:
    """Quantize every GEMM weight packed from now on (``int8``, ``int4``; ``none``: keep the
    loaded dtype), see :mod:`linserve.model.quantize`. Process-wide, set by the loader before a
    model is built; quantized weights always run the invariant GEMM, whatever the mode."""
    quantize.check_mode(mode)
    _quantization[0] = mode


def quantization() -> str:
    """The quantization :func:`pack` applies."""
    return _quantization[0]


def active() -> bool:
    """On, the kernels loaded, and no autograd to serve: the invariant GEMM runs."""
    return _enabled[0] and kernels.available() and not torch.is_grad_enabled()
