"""The process-wide modes the loader sets before a model is built: batch invariance
(``--batch-invariant``, on by default: :mod:`linserve.model.invariant`) and the quantization of
GEMM weights as they are packed (``--quantization``: :mod:`linserve.model.packing`), and
whether a vision-language checkpoint's tower is loaded, with its processor's limits
(``--limit-mm-per-prompt``, ``--mm-processor-kwargs``), and what KV caches hold
(``--kv-cache-dtype``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from linserve.model import kernels, quantize

_enabled = [True]


_quantization = ["none"]
_images: list[Any] = [True, {}, None]  # the tower wanted; the processor's overrides; mmproj


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


def set_images(wanted: bool, limits: dict[str, Any] | None = None,
               mmproj: Path | None = None) -> None:
    """Load vision towers (``wanted``; off: a vision-language checkpoint serves text only,
    its tower never read) with the image processor's ``min_pixels`` / ``max_pixels``
    overridden by ``limits``; a GGUF model's tower from llama.cpp's ``mmproj`` file."""
    _images[0], _images[1], _images[2] = wanted, dict(limits or {}), mmproj


def images_wanted() -> bool:
    return bool(_images[0])


def image_limits() -> dict[str, Any]:
    return dict(_images[1])


def mmproj() -> Path | None:
    """The mmproj file of a GGUF model's vision tower (``--mmproj``), if one was given."""
    return _images[2] if _images[0] else None


_kv_cache_dtype = ["fp32"]


def set_kv_cache_dtype(dtype: str) -> None:
    """What attention layers' KV caches made from now on hold (``--kv-cache-dtype``:
    ``fp32``, ``bf16``, ``int8``; :class:`linserve.model.state.KVEntry`)."""
    if dtype not in ("fp32", "bf16", "int8"):
        raise ValueError(f"unknown KV cache dtype {dtype!r} (fp32, bf16 or int8)")
    _kv_cache_dtype[0] = dtype


def kv_cache_dtype() -> str:
    return _kv_cache_dtype[0]
