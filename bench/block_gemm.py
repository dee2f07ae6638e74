"""``python -m bench.block_gemm``: a GGUF file's block formats multiplied natively, alone
(``invariant_mm`` on a weight packed from its blocks), GMAC/s by rows (never run by CI).

One random weight of ``--shape`` K x N a format (random blocks with finite scales, as the
GGUF tests make them), ``rows`` random activations, the median of ``--rounds`` timed rounds;
the weight of the default shape (1,024 x 4,096: 2.5 MB in Q4_K) stays in the L3, so the
figures are the kernels' arithmetic, not the memory's. BENCHMARKS.md §65 has its runs.
"""

from __future__ import annotations

import argparse
import statistics
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    p.add_argument("--shape", default="1024x4096", help="K x N")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not kernels.load():
        raise SystemExit(f"the native kernels did not load: {kernels.load_error()}")
    torch.set_num_threads(args.threads)
    k, n = (int(v) for v in args.shape.split("x"))
    for name in args.formats:
        w = packed(Q[name], k, n)
        cells = [f"{rows} rows {gmacs(w, rows, k, args.rounds):6.1f}" for rows in args.rows]
        print(f"{name:5s} GMAC/s: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
