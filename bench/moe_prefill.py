"""``python -m bench.moe_prefill``: a mixture-of-experts model's prefill in its two forms of
the sparse MLP, in one process.

- **pytorch**: :class:`linserve.model.layers.moe.SparseMoE`'s PyTorch form, the reference: tokens
  grouped by expert from Python (``torch.where``, an index, a scatter-add per expert);
- **native**: ``moe_forward`` (``linserve/model/kernels/moe_ops.cpp`` over ``moe.h``, what the
decode
  steps call): the same grouping and products in C++, activations fp32 between them.

For each prompt shape (one prompt of 128 tokens, as ``bench.families`` sends it, and 16 of
128), the whole model's prefill wall time, forms alternated ``--rounds`` times and the best
of each kept. Default checkpoint: ``bench.families``' Qwen3.5-35B-A3B shapes, first 8 of 40
layers (``python -m bench.families --models qwen3.5-35b-a3b-8l --make``). Writes
``bench/results/moe_prefill.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import machine, prefill_forms, print_table, write_json
from linserve.model import loader
from linserve.model.layers.moe import SparseMoE

SHAPES = [(1, 128), (16, 128)]


def set_form(form: str) -> None:
    SparseMoE.native = form == "native"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-35b-a3b-8l"))
    p.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = loader.load(args.checkpoint, "bfloat16", quantization=args.quantization)
    rows = prefill_forms(model, SHAPES, set_form, ("pytorch", "native"), args.rounds)
    SparseMoE.native = True
    print_table(rows, list(rows[0]))
    write_json("moe_prefill", {"machine": machine(), "threads": args.threads,
                               "checkpoint": str(args.checkpoint),
                               "quantization": args.quantization, "rows": rows})


if __name__ == "__main__":
    main()
