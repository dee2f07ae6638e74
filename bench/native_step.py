"""``python -m bench.native_step --checkpoint DIR``: the served model's decode step alone.

A checkpoint loaded as the server loads it (``--dtype``, ``--kind`` of weights), one prompt
of ``--context`` tokens prefilled per row, then the step at each ``--batches`` size timed
(the median of many; the state kept at one position). For A/B runs of a change to the
whole-model native step (``python -m bench.ab --suite native``); it uses only the loader and
the served model's ``prefill`` / ``step``, so it runs in older checkouts too. Writes
``bench/results/<--output>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, time_ms, write_json
from bench.quant import TYPES
from linserve.model import loader
from linserve.model.state import State


def measure(path: Path, kind: str, dtype: str, batch: int, context: int) -> dict[str, Any]:
    """Tokens/s of ``batch`` rows stepping at position ``context``."""
    served = loader.load(path, dtype, quantization=TYPES[kind])
    module = served.module  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    vocab = served.info.vocab_size
    _, row = served.prefill(torch.randint(0, vocab, (1, context), generator=gen))
    state = State.cat([row.copy() for _ in range(batch)])
    tokens = torch.randint(0, vocab, (batch,), generator=gen)

    def step() -> None:
        state.reserve_step(1)
        module.step(tokens, state)
        state.lengths -= 1  # the same position every call

    with torch.inference_mode():
        ms = time_ms(step, min_iters=10, min_seconds=3.0)
    return {"checkpoint": path.name, "kind": kind, "batch": batch, "context": context,
            "step_ms": round(ms, 3), "tokens_per_s": round(batch / ms * 1000, 1),
            "decode_step": served.info.decode_step}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--kind", default="int8", choices=list(TYPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", nargs="+", type=int, default=[1])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default="native_step")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(args.checkpoint, args.kind, args.dtype, b, args.context)
            for b in args.batches]
    write_json(args.output, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
