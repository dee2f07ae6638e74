"""``python -m bench.first_start``: where a first start's time goes, and what it is now.

With an empty kernel cache, in one run:

- each kernel source compiled alone (one translation unit each, as before the unity
  build), serially, and a unit that only includes the torch headers every source needs;
- the unity build (``linserve build-kernels``: two units in parallel, then the link);
- ``linserve serve`` on the shipped weights, from the command to a healthy ``/health``.

Prints a table, writes ``bench/results/first_start.json`` and ``first_start.png``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import machine, save_figure, write_json
from bench.serverproc import ROOT, free_port
from linserve.model.kernels.build import HERE, SOURCES, compiler_flags

HEADERS = "#include <ATen/ATen.h>\n#include <ATen/Parallel.h>\n#include <torch/library.h>\n"


def compile_seconds(source: Path, out: Path) -> float:
    """Wall seconds to compile ``source`` alone, with the kernels' own flags."""
    cflags, _ = compiler_flags("native")
    cmd = ["c++", *" ".join(cflags).split(), "-c", str(source), "-o", str(out)]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.monotonic() - t0


def per_source(work: Path) -> dict[str, float]:
    """Each source alone, and the torch headers alone."""
    headers = work / "headers_only.cpp"
    headers.write_text(HEADERS)
    out = {"torch headers only": compile_seconds(headers, work / "h.o")}
    for source in SOURCES:
        out[source.stem] = compile_seconds(source, work / f"{source.stem}.o")
    return out


def unity_build(work: Path) -> float:
    t0 = time.monotonic()
    subprocess.run([str(Path(sys.executable).with_name("linserve")), "build-kernels",
                    str(work / "unity")], check=True, capture_output=True)
    return time.monotonic() - t0


def first_start(work: Path) -> float:
    """Seconds from ``linserve serve`` to a healthy server, with an empty kernel cache."""
    port = free_port()
    env = {**os.environ, "LINSERVE_CACHE_DIR": str(work / "cache")}
    t0 = time.monotonic()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("linserve")), "serve",
                             str(ROOT / "weights" / "linear"), "--port", str(port)],
                            cwd=work, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    seconds = time.monotonic() - t0
                    if not list((work / "cache").glob("kernels/*/linserve_kernels.so")):
                        raise RuntimeError("the server did not build into the empty cache")
                    return seconds
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 600:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)


def plot(sources: dict[str, float], unity: float, start: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(sources)
    ax.barh(names, [sources[n] for n in names], color="#888")
    ax.barh(["before: the sources one by one (serial sum)"],
            [sum(v for k, v in sources.items() if k != "torch headers only")], color="#c63")
    ax.barh(["unity build (2 units, 2 cores)"], [unity], color="#2a7")
    ax.barh(["first linserve serve, to healthy"], [start], color="#27a")
    ax.set_xlabel("seconds")
    ax.set_title("A first start: each source alone (serial) against the unity build")
    ax.grid(alpha=0.3, axis="x")
    save_figure(fig, "first_start.png")


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="linserve-first-start-"))
    try:
        sources = per_source(work)
        unity = unity_build(work)
        start = first_start(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    alone = sum(v for k, v in sources.items() if k != "torch headers only")
    print("| what | seconds |\n| --- | --- |")
    for name, sec in sources.items():
        print(f"| {name} | {sec:.1f} |")
    print(f"| all sources one by one (serial) | {alone:.1f} |")
    print(f"| unity build, 2 units in parallel and the link | {unity:.1f} |")
    print(f"| first `linserve serve` to healthy (empty cache) | {start:.1f} |")
    write_json("first_start", {"command": "python -m bench.first_start", "machine": machine(),
                               "sources": sources, "serial_sum": alone, "unity_build": unity,
                               "first_start": start, "kernel_dir": str(HERE)})
    plot(sources, unity, start)


if __name__ == "__main__":
    main()
