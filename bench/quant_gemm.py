"""``python -m bench.quant_gemm``: the int8 / int4 products alone (``quant_mm`` through
``invariant_mm``), GMAC/s per shape, rows and thread count (never run by CI).

Each case multiplies ``rows`` random activations by random weights of [K, N] packed as
``--quantization`` packs them, cycling over ``--weights`` distinct weights so that a product
reads its weight as a model's prefill or batched step does (three of Granite-4.0-H-Micro's
MLP weights are 57 MB, beyond the L3). The figure is the median of ``--rounds`` rounds.

With ``--libs A.so B.so`` every case runs once per library, alternating, each in its own
process (``LINSERVE_KERNEL_LIB``): an A/B of two kernel builds under the same VM drift.

Writes ``bench/results/quant_gemm.json`` and ``quant_gemm.png`` (GMAC/s per case, a bar per
library).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from bench.common import machine, print_table, read_json, save_figure, write_json

SHAPES = ["2048x16384", "2048x8512", "8192x2048", "4096x2048"]  # Granite-4.0-H-Micro's


def one(kind: str, rows: int, k_len: int, n: int, threads: int, weights: int,
        rounds: int) -> float:
    """Median seconds of one product of ``rows`` rows by a [K, N] ``kind`` weight."""
    from linserve.model import kernels, quantize

    kernels.load()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    packed = [quantize.pack(torch.randn(k_len, n) * 0.02, kind) for _ in range(weights)]
    x = torch.randn(rows, k_len)
    times = []
    for _ in range(rounds):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.4:
            for w in packed:
                torch.ops.linserve.invariant_mm(x, w)
            count += len(packed)
        times.append((time.perf_counter() - start) / count)
    return sorted(times)[len(times) // 2]


def run_case(lib: str | None, case: dict[str, Any], args: argparse.Namespace) -> float:
    """Seconds of ``case`` in a fresh process with ``lib`` loaded (None: the default build)."""
    env = dict(os.environ)
    if lib:
        env["LINSERVE_KERNEL_LIB"] = lib
    cmd = [sys.executable, "-m", "bench.quant_gemm", "--one", json.dumps(
        {**case, "weights": args.weights, "rounds": args.rounds})]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def plot(rows: list[dict[str, Any]]) -> None:
    """GMAC/s per case (kind, rows, K x N, threads), one bar per library, one panel a kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in rows})
    libs = list(dict.fromkeys(r["lib"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(7.5 * len(kinds), 4.4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        cases = list(dict.fromkeys((r["rows"], r["k"], r["n"], r["threads"])
                                   for r in rows if r["kind"] == kind))
        width = 0.8 / len(libs)
        for i, lib in enumerate(libs):
            by_case = {(r["rows"], r["k"], r["n"], r["threads"]): r["gmacs"]
                       for r in rows if r["kind"] == kind and r["lib"] == lib}
            ax.bar([c + i * width for c in range(len(cases))],
                   [by_case.get(c, 0.0) for c in cases], width, label=lib)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels([f"{r} rows\n{k}x{n}\n{t} thr" for r, k, n, t in cases], fontsize=6)
        ax.set_ylabel("GMAC/s")
        ax.set_title(f"{kind} products")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    save_figure(fig, "quant_gemm.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["int4", "int8"], choices=["int4", "int8"])
    p.add_argument("--rows", nargs="+", type=int, default=[16, 512])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="KxN")
    p.add_argument("--threads", nargs="+", type=int, default=[2])
    p.add_argument("--weights", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--libs", nargs="+", default=[None], help="kernel libraries to alternate")
    p.add_argument("--plot-only", action="store_true", help="redraw from the JSON")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plot_only:
        plot(read_json("quant_gemm")["rows"])
        return
    if args.one:
        c = json.loads(args.one)
        print(one(c["kind"], c["rows"], c["k"], c["n"], c["threads"], c["weights"], c["rounds"]))
        return
    rows: list[dict[str, Any]] = []
    for kind in args.kinds:
        for shape in args.shapes:
            k_len, n = (int(v) for v in shape.split("x"))
            for r in args.rows:
                for threads in args.threads:
                    case = {"kind": kind, "rows": r, "k": k_len, "n": n, "threads": threads}
                    for lib in args.libs:
                        seconds = run_case(lib, case, args)
                        rows.append({**case, "lib": lib or "default", "ms": seconds * 1e3,
                                     "gmacs": r * k_len * n / seconds / 1e9})
    print_table(rows, ["kind", "rows", "k", "n", "threads", "lib", "ms", "gmacs"])
    command = "python -m bench.quant_gemm " + " ".join(argv if argv is not None else sys.argv[1:])
    write_json("quant_gemm", {"command": command, "machine": machine(), "rows": rows})
    plot(rows)


if __name__ == "__main__":
    main()
