"""``python -m bench.moe_prefill``: a mixture-of-experts model's prefill in its two forms of
the sparse MLP, in one process.

- **pytorch**: :class:`model.layers.moe.SparseMoE`'s PyTorch form, the reference: tokens
  grouped by expert from Python (``torch.where``, an index, a scatter-add per expert);
- **native**: ``moe_forward`` (``model/kernels/moe_ops.cpp`` over ``moe.h``, what the decode
  steps call): the same grouping and products in C++, activations fp32 between them.

For each prompt shape (one prompt of 128 tokens, as ``bench.families`` sends it, and 16 of
128), the whole model's prefill wall time, forms alternated ``--rounds`` times and the best
of each kept. Default checkpoint: ``bench.families``' Qwen3.5-35B-A3B shapes, first 8 of 40
layers (``python -m bench.families --models qwen3.5-35b-a3b-8l --make``). Writes
``bench/results/moe_prefill.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, write_json
from model import loader
from model.layers.moe import SparseMoE

SHAPES = [(1, 128), (16, 128)]


def prefill_seconds(model: Any, rows: int, tokens: int, native: bool) -> float:
    """Wall seconds of one prefill of ``rows`` random prompts of ``tokens``."""
    SparseMoE.native = native
    ids = torch.randint(0, 8000, (rows, tokens), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model.prefill(ids)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-35b-a3b-8l"))
    p.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = loader.load(args.checkpoint, "bfloat16", quantization=args.quantization)
    rows: list[dict[str, Any]] = []
    for b, t in SHAPES:
        best = {"pytorch": float("inf"), "native": float("inf")}
        for form in best:  # warm-up: the first prefill of a shape allocates
            prefill_seconds(model, b, t, form == "native")
        for _ in range(args.rounds):
            for form in best:
                best[form] = min(best[form], prefill_seconds(model, b, t, form == "native"))
        rows.append({"prompts": b, "tokens": t, "pytorch_s": round(best["pytorch"], 2),
                     "native_s": round(best["native"], 2),
                     "pytorch_tok_s": round(b * t / best["pytorch"], 1),
                     "native_tok_s": round(b * t / best["native"], 1),
                     "speedup": round(best["pytorch"] / best["native"], 2)})
    SparseMoE.native = True
    print_table(rows, list(rows[0]))
    write_json("moe_prefill", {"machine": machine(), "threads": args.threads,
                               "checkpoint": str(args.checkpoint),
                               "quantization": args.quantization, "rows": rows})


if __name__ == "__main__":
    main()
