"""``python -m bench.gdn_prefill``: the Gated DeltaNet prefill's two forms of the delta rule
on the published Qwen3.5-0.8B shapes (``bench.hf``'s checkpoint), in one process.

- **chunked**: the chunk / WY form in PyTorch (64-token chunks: small matrix products, a
  triangular solve, transposes), the reference and the path without native kernels;
- **scan**: the recurrent form natively (``gdn_scan`` in ``model/kernels/gdn_step.cpp``): per
  (row, head) one pass over the state a token, the state kept in cache, with the
  convolution, SiLU and q/k norms in the same call.

For each prompt shape (16 prompts of 128 tokens, as the 16-stream load test sends them, and
one of 2,048), the whole model's prefill wall time, forms alternated ``--rounds`` times and
the best of each kept. Writes ``bench/results/gdn_prefill.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, write_json
from model import loader
from model.layers.gated_delta import GatedDeltaNet

SHAPES = [(16, 128), (1, 2048)]


def prefill_seconds(model: Any, rows: int, tokens: int, native: bool) -> float:
    """Wall seconds of one prefill of ``rows`` random prompts of ``tokens``."""
    GatedDeltaNet.native_scan = native
    ids = torch.randint(0, 8000, (rows, tokens), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model.prefill(ids)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = loader.load(args.checkpoint, "bfloat16")
    model.prefill(torch.zeros(2, 32, dtype=torch.long))  # warm-up
    rows: list[dict[str, Any]] = []
    for b, t in SHAPES:
        best = {"chunked": float("inf"), "scan": float("inf")}
        for _ in range(args.rounds):
            for form in best:
                best[form] = min(best[form], prefill_seconds(model, b, t, form == "scan"))
        rows.append({"prompts": b, "tokens": t, "chunked_s": round(best["chunked"], 2),
                     "scan_s": round(best["scan"], 2),
                     "chunked_tok_s": round(b * t / best["chunked"], 1),
                     "scan_tok_s": round(b * t / best["scan"], 1),
                     "speedup": round(best["chunked"] / best["scan"], 2)})
    GatedDeltaNet.native_scan = True
    print_table(rows, list(rows[0]))
    write_json("gdn_prefill", {"machine": machine(), "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
