"""Native kernels: the fused decode steps (``linear_step.cpp`` for linear attention,
``softmax_step.cpp`` for the softmax baselines, sharing ``dense.h``), the prefill's causal
convolution and GELU (``prefill_ops.cpp``) and the fused temperature / min-p sampler
(``sampling.cpp``).

The C++ sources are compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler
and ninja are needed then, once; the result is cached) or loaded from a prebuilt library,
which is how the Docker image ships it without a compiler:

- ``LINSERVE_KERNEL_LIB=/path/linserve_kernels.so``: load this prebuilt library.
- ``LINSERVE_KERNEL_DIR=/opt/kernels``: prebuilt libraries for several CPU levels, one per
  sub-folder (``x86-64-v4-bf16/``, ``x86-64-v3/``, ``x86-64/``); the best one this CPU runs
  is loaded
  (:func:`pick_arch`), so an image built once never runs AVX2 code on a CPU without it.
- ``LINSERVE_KERNEL_ARCH`` (default ``native``): the ``-march`` the source is compiled for
  (``x86-64-v3`` is AVX2 + FMA, ``x86-64-v4`` AVX-512): the kernels' switch of instruction
  set, as ``ATEN_CPU_CAPABILITY`` is ATen's.
- ``python -m model.kernels build DIR``: compile into DIR and print the library's path.

:func:`load` never raises: without a compiler it returns False and the model keeps its eager
step, which computes the same thing.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(n) for n in
           ("linear_step.cpp", "softmax_step.cpp", "prefill_ops.cpp", "sampling.cpp",
            "gemm.cpp", "gdn_step.cpp", "qwen35_step.cpp", "decoder_step.cpp",
            "moe_ops.cpp")]
NAME = "linserve_kernels"
_state: dict[str, bool | str] = {}


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
LEVELS = [("x86-64-v4-bf16", X86_64_V4_BF16_FLAGS), ("x86-64-v4", X86_64_V4_FLAGS),
          ("x86-64-v3", X86_64_V3_FLAGS), ("x86-64", frozenset())]


def march_flags(arch: str) -> list[str]:
    """Compiler flags of a level: ``-march=ARCH``, and for ``x86-64-v4-bf16`` the v4 level
    plus AVX512-BF16 and AVX512-VNNI (every CPU with the first has the second)."""
    if arch == "x86-64-v4-bf16":
        return ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"]
    return [f"-march={arch}"]


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


STALE_LOCK_SECONDS = 600.0


def clear_stale_lock(build_dir: Path) -> None:
    """Remove a build lock left by a process killed while compiling. torch's extension
    builder waits for ``lock`` to disappear and never times out, so a server (or test run)
    killed during its first compile left every later start hanging. A build takes a minute
    or two here; a lock older than :data:`STALE_LOCK_SECONDS` has no live owner."""
    import time

    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("kernels: removing a stale build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


def build(directory: str | Path | None = None, verbose: bool = False) -> str:
    """Compile the kernels (cached by source and flags) and load them; returns the .so path."""
    from torch.utils import cpp_extension

    arch = os.environ.get("LINSERVE_KERNEL_ARCH", "native")
    build_dir = None if directory is None else str(directory)
    if build_dir is not None:
        Path(build_dir).mkdir(parents=True, exist_ok=True)
    # The default cache keeps one build per -march, so switching LINSERVE_KERNEL_ARCH (the
    # tests run each instruction set this CPU has) does not rebuild over the other.
    name = NAME if build_dir is not None or arch == "native" else f"{NAME}_{arch.replace('-', '_')}"
    clear_stale_lock(Path(build_dir or cpp_extension._get_build_directory(name, False)))
    path = cpp_extension.load(
        name=name, sources=[str(s) for s in SOURCES],
        # -fopenmp: at::parallel_for is an inline OpenMP loop, serial without it; the library
        # then shares torch's own libgomp.so.1 (already loaded, same soname) and its threads.
        extra_cflags=["-O3", *march_flags(arch), "-fopenmp", "-fno-math-errno"],
        extra_ldflags=["-fopenmp"],
        build_directory=build_dir,
        is_python_module=False, verbose=verbose)
    return str(path)


def load() -> bool:
    """Make the fused step available (prebuilt library, else compile); False if impossible."""
    if "ok" in _state:
        return bool(_state["ok"])
    ok = is_loaded()
    lib = prebuilt_library()
    try:
        if not ok and lib:
            torch.ops.load_library(lib)
        elif not ok:
            build()
        ok = is_loaded()
    except Exception as exc:  # no compiler, no ninja, a bad library: fall back to eager
        _state["error"] = f"{type(exc).__name__}: {exc}"
        log.warning("fused step unavailable, using the eager step (%s)", _state["error"])
        ok = False
    _state["ok"] = ok
    return ok


def available() -> bool:
    """Whether the kernels are loaded, without trying to build them (cheap, per call)."""
    return bool(_state.get("ok"))


def load_error() -> str | None:
    """Why :func:`load` failed, if it did."""
    err = _state.get("error")
    return str(err) if err else None


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "build":
        raise SystemExit("usage: python -m model.kernels build DIR")
    print(build(args[1], verbose=True))
