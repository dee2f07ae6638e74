"""``python -m bench.gemv_read``: the batch-1 GEMV against the machine's read bandwidth, on
the same threads (never run by CI).

A batch-1 decode step reads every weight once, so its ceiling is the DRAM read bandwidth.
Eight ``[2048, 16384]`` weights (512 MB in bf16, well past any cache), packed as the server
packs them (``--kind``: bf16 pairs, or int8 / int4), are multiplied by one row in turn, and
the bytes read per second are set against ``bench.roofline``'s native four-stream read of a
512 MiB buffer on the same ``--threads``, the two alternating ``--rounds`` times.
``ratio``: GEMV GB/s over read GB/s (1.0: the GEMV reads as fast as the machine can).
Writes ``bench/results/gemv_read.json``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench.common import machine, print_table, write_json
from bench.roofline import stream_read
from linserve.model import kernels, packing, quantize


def gb_per_s(fn: Callable[[], object], nbytes: int) -> float:
    """``nbytes`` over the seconds one call of ``fn`` takes, in GB/s."""
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["bf16", "int8", "int4"], default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    assert kernels.load(), kernels.load_error()
    read = stream_read()
    assert read is not None, "the native read probe did not build"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    raw = [torch.randn(2048, 16384) * 0.02 for _ in range(8)]
    ws = [packing.pack(w.bfloat16()) if args.kind == "bf16" else quantize.pack(w, args.kind)
          for w in raw]
    del raw
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    x, src = torch.randn(1, 2048), torch.ones(512 * 2**20 // 4)
    rows = []
    with torch.no_grad():
        for _ in range(args.rounds):
            gemv = gb_per_s(lambda: [torch.ops.linserve.invariant_mm(x, w) for w in ws], nbytes)
            stream = gb_per_s(lambda: read(src), src.numel() * 4)
            rows.append({"gemv_gbs": gemv, "read_gbs": stream, "ratio": gemv / stream})
            print_table(rows[-1:], list(rows[-1]))
    ratios = sorted(r["ratio"] for r in rows)
    write_json("gemv_read", {"command": "python -m bench.gemv_read", "machine": machine(),
                             "kind": args.kind, "threads": args.threads, "bytes": nbytes,
                             "rounds": rows, "median_ratio": ratios[len(ratios) // 2]})


if __name__ == "__main__":
    main()
