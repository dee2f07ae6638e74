"""Loading a checkpoint folder as a :class:`model.interface.ServedModel`.

Each architecture family registers how to recognise its checkpoints and load them; the
server calls :func:`load` and :func:`max_state_bytes` and never imports a family itself.
Only the project's own format is known so far (:mod:`model.architectures.linserve`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model import invariant
from model.architectures.linserve import OwnModel, is_own_checkpoint
from model.architectures.linserve import max_state_bytes as own_max_state_bytes
from model.interface import ServedModel
from model.kernels import cpu_flags

# CPU flags (as /proc/cpuinfo names them) of native bf16 dot products: AVX512-BF16's
# vdpbf16ps and AMX's tile products. Without them oneDNN emulates bf16 through fp32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class CheckpointError(ValueError):
    """A checkpoint this server cannot load; the message is one line for the startup log."""


@dataclass(frozen=True)
class Family:
    """How to recognise, size and load one architecture family's checkpoints."""

    name: str
    recognise: Callable[[Path], bool]
    load: Callable[[Path, torch.dtype, bool], ServedModel]
    max_state_bytes: Callable[[Path], int]


FAMILIES = [Family("linserve", is_own_checkpoint, OwnModel.load, own_max_state_bytes)]


def family(path: Path) -> Family:
    """The family whose checkpoints look like ``path``."""
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a checkpoint folder)")
    for fam in FAMILIES:
        if fam.recognise(path):
            return fam
    raise CheckpointError(f"{path}: config.json matches no known architecture")


def pick_dtype(requested: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """The weight dtype to load (``float32`` or ``bfloat16``) and why, for the startup log
    and ``/health``. ``auto`` is bf16 exactly where the CPU has native bf16 products."""
    if requested != "auto":
        return requested, f"--dtype {requested} was set"
    have = [f for f in BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if have:
        return "bfloat16", f"auto: the CPU has native bf16 dot products ({', '.join(have)})"
    return "float32", "auto: the CPU has neither AVX512-BF16 nor AMX, so bf16 would be emulated"


def load(path: Path, dtype: str = "auto", fused: bool = True,
         batch_invariant: bool = True) -> ServedModel:
    """Load the checkpoint at ``path`` with weights in ``dtype`` (see :func:`pick_dtype`),
    the native fused step where the architecture has one, and batch-invariant kernels
    (:mod:`model.invariant`) unless turned off."""
    fam = family(path)
    invariant.set_enabled(batch_invariant)
    return fam.load(path, getattr(torch, pick_dtype(dtype)[0]), fused)


def max_state_bytes(path: Path) -> int:
    """The largest one-session state the checkpoint at ``path`` can have, without loading
    its weights (the bound on an imported blob)."""
    return family(path).max_state_bytes(path)


def batch_invariant_active() -> bool:
    """Whether batch-invariant kernels are running in this process."""
    return invariant.active()
