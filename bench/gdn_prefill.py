"""``python -m bench.gdn_prefill``: the Gated DeltaNet prefill's two forms of the delta rule
on the published Qwen3.5-0.8B shapes (``bench.hf``'s checkpoint), in one process.

- **chunked**: the chunk / WY form in PyTorch (64-token chunks: small matrix products, a
  triangular solve, transposes), the reference and the path without native kernels;
- **scan**: the recurrent form natively (``gdn_scan`` in ``linserve/model/kernels/gdn_step.cpp``):
per
  (row, head) one pass over the state a token, the state kept in cache, with the
  convolution, SiLU and q/k norms in the same call.

For each prompt shape (16 prompts of 128 tokens, as the 16-stream load test sends them, and
one of 2,048), the whole model's prefill wall time, forms alternated ``--rounds`` times and
the best of each kept. Writes ``bench/results/gdn_prefill.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import machine, prefill_forms, print_table, write_json
from linserve.model import loader
from linserve.model.layers.gated_delta import GatedDeltaNet

SHAPES = [(16, 128), (1, 2048)]


def set_form(form: str) -> None:
    GatedDeltaNet.native_scan = form == "scan"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = loader.load(args.checkpoint, "bfloat16")
    rows = prefill_forms(model, SHAPES, set_form, ("chunked", "scan"), args.rounds)
    GatedDeltaNet.native_scan = True
    print_table(rows, list(rows[0]))
    write_json("gdn_prefill", {"machine": machine(), "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
