"""Native kernels: the fused decode steps (``linear_step.cpp`` for linear attention,
``softmax_step.cpp`` for the softmax baselines, sharing ``dense.h``), the prefill's causal
convolution and GELU (``prefill_ops.cpp``) and the fused temperature / min-p sampler
(``sampling.cpp``).

The C++ sources are compiled on first use (:mod:`.build`: a C++ compiler and ninja are needed
then, once; the result is cached under ``~/.cache/linserve/kernels``, or
``LINSERVE_CACHE_DIR``) or loaded from a prebuilt library, which is how the Docker image ships
it without a compiler:

- ``LINSERVE_KERNEL_LIB=/path/linserve_kernels.so``: load this prebuilt library.
- ``LINSERVE_KERNEL_DIR=/opt/kernels``: prebuilt libraries for several CPU levels, one per
  sub-folder (``x86-64-v4-amx/``, ``x86-64-v4-bf16/``, ``x86-64-v3/``, ``x86-64/``); the
  best one this CPU runs is loaded (:func:`pick_arch`), so an image built once never runs
  AVX2 code on a CPU without it.
- ``LINSERVE_KERNEL_ARCH`` (default ``native``): the ``-march`` the source is compiled for
  (``x86-64-v3`` is AVX2 + FMA, ``x86-64-v4`` AVX-512): the kernels' switch of instruction
  set, as ``ATEN_CPU_CAPABILITY`` is ATen's.
- ``linserve build-kernels DIR``: compile into DIR and print the library's path.

:func:`load` never raises: without a compiler it returns False and the model keeps its eager
step, which computes the same thing.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

from linserve.model.kernels.build import (  # noqa: F401 (the package's interface)
    NAME,
    SOURCES,
    build,
    build_lock,
    default_build_dir,
    march_flags,
)
from linserve.model.kernels.build import cached as build_cached

log = logging.getLogger(__name__)
_state: dict[str, bool | str | float] = {}


def is_loaded() -> bool:
    """True once ``torch.ops.linserve.linear_step`` is registered in this process."""
    try:
        torch.ops.linserve.linear_step  # noqa: B018 (attribute lookup raises if missing)
    except (AttributeError, RuntimeError):
        return False
    return True


# What -march=x86-64-v3 may use (its psABI level), as /proc/cpuinfo names the flags.
X86_64_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe",
                             "xsave"})


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty when they cannot be read)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# x86-64-v4 (AVX-512 F/BW/CD/DQ/VL), and the same with AVX512-BF16 and AVX512-VNNI, which the
# batch-invariant GEMM uses for bf16 weights (vdpbf16ps: twice the products of fp32 FMAs) and
# for int8 / int4 ones (vpdpbusd).
X86_64_V4_FLAGS = X86_64_V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_64_V4_BF16_FLAGS = X86_64_V4_FLAGS | {"avx512_bf16", "avx512_vnni"}
# ... and AMX tiles, on which bf16 GEMMs of several rows run 3-5x faster (gemm_amx.h), and
# int8 / int4 ones of 32 rows or more 1.3-1.6x (gemm_quant_amx.h).
X86_64_V4_AMX_FLAGS = X86_64_V4_BF16_FLAGS | {"amx_tile", "amx_bf16", "amx_int8"}
LEVELS = [("x86-64-v4-amx", X86_64_V4_AMX_FLAGS), ("x86-64-v4-bf16", X86_64_V4_BF16_FLAGS),
          ("x86-64-v4", X86_64_V4_FLAGS), ("x86-64-v3", X86_64_V3_FLAGS),
          ("x86-64", frozenset())]


def pick_arch(flags: frozenset[str], offered: list[str]) -> str | None:
    """The best of the ``offered`` prebuilt levels this CPU can run (None: none fits)."""
    for level, needs in LEVELS:
        if level in offered and flags >= needs:
            return level
    return None


def prebuilt_library() -> str | None:
    """The prebuilt library to load: ``LINSERVE_KERNEL_LIB``, else the best level under
    ``LINSERVE_KERNEL_DIR``."""
    lib = os.environ.get("LINSERVE_KERNEL_LIB")
    root = os.environ.get("LINSERVE_KERNEL_DIR")
    if lib or not root:
        return lib
    offered = [p.parent.name for p in Path(root).glob(f"*/{NAME}.so")]
    arch = pick_arch(cpu_flags(), offered)
    if arch is None:
        return None
    log.info("kernels: loading the %s build", arch)
    return str(Path(root) / arch / f"{NAME}.so")


def load() -> bool:
    """Make the fused step available (prebuilt library, else compile); False if impossible."""
    if "ok" in _state:
        return bool(_state["ok"])
    ok = is_loaded()
    lib = prebuilt_library()
    try:
        if not ok:
            t0 = time.monotonic()
            if lib:
                torch.ops.load_library(lib)
                _state["source"] = f"prebuilt {lib}"
            else:
                built = build()
                torch.ops.load_library(built.path)
                _state["source"] = ("compiled for this CPU" if built.compiled
                                    else "this CPU's cached build")
            _state["seconds"] = time.monotonic() - t0
        ok = is_loaded()
    except Exception as exc:  # no compiler, no ninja, a bad library: fall back to eager
        _state["error"] = f"{type(exc).__name__}: {exc}"
        log.warning("fused step unavailable, using the eager step (%s)", _state["error"])
        ok = False
    _state["ok"] = ok
    return ok


def cached() -> bool:
    """Whether :func:`load` would load a library without compiling one: loaded already, a
    prebuilt one, or this CPU's build in the cache up to date."""
    return is_loaded() or bool(prebuilt_library()) or build_cached()


def available() -> bool:
    """Whether the kernels are loaded, without trying to build them (cheap, per call)."""
    return bool(_state.get("ok"))


def build_seconds() -> float:
    """Seconds this process spent building (or finding in the cache) and loading the
    kernels: the first start's compile shows here."""
    return float(_state.get("seconds", 0.0))


def describe() -> str:
    """One phrase for the startup log: where the kernels came from and what they cost."""
    if not available():
        return f"unavailable, eager steps ({load_error() or 'not loaded'})"
    return f"{_state.get('source', 'loaded')}, {build_seconds():.1f} s"


def load_error() -> str | None:
    """Why :func:`load` failed, if it did."""
    err = _state.get("error")
    return str(err) if err else None


def bf16_gemm() -> str:
    """What multiplies bf16 weights in this process, for the startup log and ``/health``:
    ``amx`` (tiles, gemm_amx.h), ``avx512-bf16`` (vdpbf16ps), ``fp32-fma`` (widened to fp32)
    or ``aten`` (no kernels)."""
    if not available():
        return "aten"
    if torch.ops.linserve.amx_active():
        return "amx"
    return "avx512-bf16" if torch.ops.linserve.has_bf16_dot() else "fp32-fma"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "build":
        raise SystemExit("usage: linserve build-kernels DIR")
    print(build(args[1], verbose=True).path)
