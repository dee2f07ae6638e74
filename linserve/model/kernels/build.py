"""Compiling the native kernels: a ninja build of two unity units, logged as it goes.

Where a first start's time went (2 cores, GCC 12, ``-O3 -march=native``; BENCHMARKS.md has
the table): the nine sources cost 107 s of compiler time one by one, and 47 s of it was the
same torch headers parsed nine times (``ATen/ATen.h`` and ``torch/library.h``: 5.2 s per
translation unit, of which ``torch/library.h`` alone is 4.1 s, so including less of ATen saves
little while every source registers its ops). So the sources are compiled as two *unity
units*, each one translation unit that includes several ``.cpp`` files: the headers are
parsed twice instead of nine times, and the two units, balanced by their own compile time,
keep both cores busy. The sources keep their code in named namespaces so that they can
share a unit.

The build is a ``build.ninja`` written here rather than ``torch.utils.cpp_extension.load``, so
that the log says what is being built and each unit's line comes as it finishes; ninja's
own bookkeeping (dependency files, command hashes) decides what is up to date, so a second
start links nothing and loads the cached library at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from linserve.model.cache_dirs import cache_root

log = logging.getLogger("linserve.kernels")
HERE = Path(__file__).parent
NAME = "linserve_kernels"
# The units, balanced by each source's own compile time beyond the shared headers
# (decoder_step 9.9 s, prefill_ops 3.9, gdn_step 2.7, sampling 1.4;
# gemm 8.9, linear_step 8.3, moe_ops 8.3, softmax_step 8.2).
UNITS: dict[str, tuple[str, ...]] = {
    "hybrid_steps": ("decoder_step", "gdn_step", "rwkv_ops", "mlstm_ops", "prefill_ops",
                     "sampling"),
    "gemm_and_own_steps": ("gemm", "linear_step", "softmax_step", "moe_ops"),
}
SOURCES = [HERE / f"{stem}.cpp" for stems in UNITS.values() for stem in stems]
# Seconds a first build takes on two cores (19 s on a Zen 4 EPYC, BENCHMARKS.md; 29.7 s since
# the GGUF block formats and the newest hybrids' native parts), for the log's "usually takes"
# line.
TYPICAL_SECONDS = 30


def march_flags(arch: str) -> list[str]:
    """Compiler flags of a level: ``-march=ARCH``, and for ``x86-64-v4-bf16`` the v4 level
    plus AVX512-BF16 and AVX512-VNNI (every CPU with the first has the second), for
    ``x86-64-v4-amx`` those plus AMX-TILE, AMX-BF16 and AMX-INT8."""
    if arch == "x86-64-v4-bf16":
        return ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"]
    if arch == "x86-64-v4-amx":
        return ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
                "-mamx-int8"]
    return [f"-march={arch}"]


def compiler_flags(arch: str) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for a library that registers torch ops. ``-fopenmp``:
    ``at::parallel_for`` is an inline OpenMP loop, serial without it; the library then shares
    torch's own libgomp.so.1 (already loaded, same soname) and its threads."""
    import torch

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes, libraries = torch_paths()
    cflags = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{HERE}",
              *(f"-isystem {p}" for p in includes),
              "-fPIC", "-std=c++20", "-O3", *march_flags(arch), "-fopenmp", "-fno-math-errno"]
    ldflags = ["-shared", "-fopenmp", *(f"-L{p}" for p in libraries),
               "-lc10", "-ltorch_cpu", "-ltorch"]
    return cflags, ldflags


def torch_paths() -> tuple[list[str], list[str]]:
    """torch's include and library folders, as ``torch.utils.cpp_extension`` gives them.
    Importing that module (and setuptools with it) took 1.2 s of every start, build or no
    build, so its answer is kept under :func:`cache_root`, named by torch's version and
    place."""
    import torch

    key = hashlib.sha1(f"{torch.__version__}:{Path(torch.__file__).resolve()}".encode())
    kept = cache_root() / "kernels" / f"torch-paths-{key.hexdigest()[:12]}.json"
    try:
        found = json.loads(kept.read_text())
        return list(found["include"]), list(found["lib"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from torch.utils import cpp_extension

    includes, libraries = cpp_extension.include_paths(), cpp_extension.library_paths()
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"include": includes, "lib": libraries}))
        tmp.replace(kept)
    except OSError:
        pass
    return includes, libraries


def write_ninja(build_dir: Path, arch: str) -> Path:
    """Write ``build_dir``'s unity sources and ``build.ninja``; returns the library's path."""
    cflags, ldflags = compiler_flags(arch)
    lines = ["ninja_required_version = 1.3", f"cxx = {os.environ.get('CXX', 'c++')}",
             f"cflags = {' '.join(cflags)}", f"ldflags = {' '.join(ldflags)}", "",
             "rule compile", "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
             "  depfile = $out.d", "  deps = gcc", "  description = $unit", "",
             "rule link", "  command = $cxx $in $ldflags -o $out",
             "  description = link", ""]
    for unit, stems in UNITS.items():
        source = build_dir / f"{unit}.cpp"
        text = "".join(f'#include "{HERE / stem}.cpp"\n' for stem in stems)
        if not source.exists() or source.read_text() != text:  # unchanged: ninja skips it
            source.write_text(text)
        lines += [f"build {unit}.o: compile {source}", f"  unit = {unit}"]
    library = build_dir / f"{NAME}.so"
    lines += [f"build {library.name}: link {' '.join(f'{u}.o' for u in UNITS)}",
              f"default {library.name}", ""]
    (build_dir / "build.ninja").write_text("\n".join(lines))
    return library


def default_build_dir(name: str) -> Path:
    """The cache folder for ``name``, one per source checkout (two checkouts, a CI clone
    beside a working tree, writing one folder rebuilt it in turn on every start), under
    :func:`cache_root`."""
    where = hashlib.sha1(str(HERE.resolve()).encode()).hexdigest()[:10]
    return cache_root() / "kernels" / f"{name}-{where}"


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build in ``build_dir`` alone, with an ``flock``, which the kernel releases
    when its holder dies, however it dies: a server killed while compiling never leaves a
    lock that makes every later start wait."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "linserve.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def up_to_date(build_dir: Path) -> bool:
    """Whether ninja has nothing to do (``ninja -n``: a dry run, no compiler started)."""
    out = subprocess.run([ninja_command(), "-C", str(build_dir), "-n"], capture_output=True,
                         text=True, check=False)
    return out.returncode == 0 and "no work to do" in out.stdout


def ninja_command() -> str:
    """The ninja executable: the ``ninja`` package's, beside this Python, else on PATH."""
    beside = Path(sys.executable).with_name("ninja")
    return str(beside) if beside.exists() else "ninja"


def run_ninja(build_dir: Path, arch: str, verbose: bool) -> None:
    """Run the build, logging one line as each unit finishes; raises with the compiler's
    output when it fails."""
    t0 = time.monotonic()
    log.info("kernels: no up-to-date build for this CPU and checkout, so compiling the "
             "native kernels for this CPU (-march=%s) into %s: %d units, %d sources; the "
             "first build on a machine usually takes ~%d s on 2 cores, later starts load the "
             "cached library at once (LINSERVE_KERNEL_DIR: prebuilt ones)", arch, build_dir,
             len(UNITS), len(SOURCES), TYPICAL_SECONDS)
    jobs = str(max(1, min(len(UNITS), os.cpu_count() or 1)))
    env = {**os.environ, "NINJA_STATUS": "[%f/%t] "}
    proc = subprocess.Popen([ninja_command(), "-C", str(build_dir), "-j", jobs], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output = []
    for line in proc.stdout:
        output.append(line)
        if verbose:
            print(line, end="", file=sys.stderr)
        if line.startswith("["):  # "[1/3] hybrid_steps": printed as the edge finishes
            step, what = line.strip().split(" ", 1)
            detail = ", ".join(UNITS.get(what, ()))
            log.info("kernels: %s %s%s done at %.1f s", step, what,
                     f" ({detail})" if detail else "", time.monotonic() - t0)
    if proc.wait() != 0:
        raise RuntimeError("kernel build failed:\n" + "".join(output[-60:]))


@dataclass(frozen=True)
class Built:
    """A build's library and whether this call compiled it (else it was up to date)."""

    path: str
    compiled: bool


def build_dir_for(directory: str | Path | None = None) -> tuple[Path, str]:
    """The build folder (``directory``, else the per-checkout, per-``LINSERVE_KERNEL_ARCH``
    cache folder) and the -march level."""
    arch = os.environ.get("LINSERVE_KERNEL_ARCH", "native")
    name = NAME if directory is not None or arch == "native" else \
        f"{NAME}_{arch.replace('-', '_')}"
    return (Path(directory) if directory is not None else default_build_dir(name)), arch


def cached() -> bool:
    """Whether :func:`build` would find the default build up to date (and compile
    nothing)."""
    build_dir, arch = build_dir_for()
    with build_lock(build_dir):
        library = write_ninja(build_dir, arch)
        return library.exists() and up_to_date(build_dir)


def build(directory: str | Path | None = None, verbose: bool = False) -> Built:
    """Compile the kernels (cached: ninja rebuilds only what changed) into ``directory``, by
    default a per-checkout, per-``LINSERVE_KERNEL_ARCH`` cache folder.
    The default cache keeps one build per -march, so switching ``LINSERVE_KERNEL_ARCH`` (the
    tests run each instruction set this CPU has) does not rebuild over the other."""
    build_dir, arch = build_dir_for(directory)
    with build_lock(build_dir):
        library = write_ninja(build_dir, arch)
        if library.exists() and up_to_date(build_dir):
            return Built(str(library), compiled=False)
        t0 = time.monotonic()
        run_ninja(build_dir, arch, verbose)
        log.info("kernels: built in %.1f s: %s", time.monotonic() - t0, library)
    return Built(str(library), compiled=True)
