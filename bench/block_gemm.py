"""``python -m bench.block_gemm``: a GGUF file's block formats multiplied natively, alone
(``invariant_mm`` on a weight packed from its blocks), GMAC/s by rows (never run by CI).

One random weight of ``--shape`` K x N a format (random blocks with finite scales, as the
GGUF tests make them), ``rows`` random activations, the median of ``--rounds`` timed rounds;
the weight of the default shape (1,024 x 4,096: 2.5 MB in Q4_K) stays in the L3, so the
figures are the kernels' arithmetic, not the memory's. BENCHMARKS.md §65 has its runs.

With ``--libs A.so B.so`` each library runs in its own process (``LINSERVE_KERNEL_LIB``),
A, B, A, B ... for ``--alternations`` rounds, and each cell reports its best and median
round: an A/B of two kernel builds on a VM whose speed drifts by a fifth within minutes
(BENCHMARKS.md §71).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

from linserve.model import kernels
from linserve.model.gguf.checkpoint import NATIVE, block_values
from linserve.model.gguf.files import Tensor
from tests.model.gguf_fixtures import random_blocks


def packed(qtype: Q, k: int, n: int) -> torch.Tensor:
    """A random [K, N] weight in ``qtype``'s blocks, packed for the quantized GEMM."""
    raw = random_blocks(qtype, n, k, seed=1)
    q, scales = block_values(Tensor("w", (n, k), qtype, raw, raw.nbytes))
    if qtype == Q.Q8_0:
        q = q.clamp(-127, 127)  # (a file's Q8_0 with -128 is served dequantized)
    scales = scales.t() if scales.dim() == 2 else scales.permute(2, 1, 0)
    return torch.ops.linserve.pack_quantized(q.t(), scales, NATIVE[qtype])


def gmacs(w: torch.Tensor, rows: int, k: int, rounds: int) -> float:
    x = torch.randn(rows, k)
    torch.ops.linserve.invariant_mm(x, w)
    reps = max(3, 2000 // rows)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.ops.linserve.invariant_mm(x, w)
        times.append((time.perf_counter() - t0) / reps)
    return rows * w.shape[1] * k / statistics.median(times) / 1e9


def alternate(args: argparse.Namespace) -> None:
    """Each of ``args.libs`` in turn, ``args.alternations`` times; best and median a cell."""
    child = ["--formats", *args.formats, "--shape", args.shape, "--threads", str(args.threads),
             "--rounds", str(args.rounds), "--rows", *map(str, args.rows), "--json"]
    cells: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.alternations):
        for lib in args.libs:
            out = subprocess.run([sys.executable, "-m", "bench.block_gemm", *child],
                                 env={**os.environ, "LINSERVE_KERNEL_LIB": lib}, check=True,
                                 capture_output=True, text=True).stdout
            for name, row in json.loads(out.splitlines()[-1]).items():
                cells.setdefault((name, lib), []).append(row)
    for (name, lib), runs in sorted(cells.items()):
        best = " ".join(f"{max(r[k] for r in runs):6.1f}" for k in runs[0])
        med = " ".join(f"{statistics.median(r[k] for r in runs):6.1f}" for k in runs[0])
        print(f"{name:5s} {lib}\n      rows {' '.join(runs[0])}: best {best} | median {med}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    p.add_argument("--shape", default="1024x4096", help="K x N")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--libs", nargs="+", help="kernel libraries to compare, alternately")
    p.add_argument("--alternations", type=int, default=4)
    p.add_argument("--json", action="store_true", help="one JSON line of GMAC/s at the end")
    args = p.parse_args(argv)
    if args.libs:
        return alternate(args)
    if not kernels.load():
        raise SystemExit(f"the native kernels did not load: {kernels.load_error()}")
    torch.set_num_threads(args.threads)
    k, n = (int(v) for v in args.shape.split("x"))
    result: dict[str, dict[str, float]] = {}
    for name in args.formats:
        w = packed(Q[name], k, n)
        result[name] = {str(rows): gmacs(w, rows, k, args.rounds) for rows in args.rows}
        if not args.json:
            cells = [f"{rows} rows {v:6.1f}" for rows, v in result[name].items()]
            print(f"{name:5s} GMAC/s: " + " | ".join(cells), flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
