"""``python -m bench.prefill``: how close a prompt's prefill comes to the limit of its GEMMs,
and how prefill and the batch-64 decode step scale from 1 to 2 threads.

1. **GEMM limit**: a ``--tokens``-token prefill of the shipped model (last logits only, as
   the server runs it), against the same-shape matrix products alone, timed in the same
   process: per layer ``[T, d] @ [d, 3d]`` (q, k, v), ``[T, d] @ [d, d]`` (out),
   ``[T, d] @ [d, d_ff]`` and ``[T, d_ff] @ [d_ff, d]`` (MLP) and the chunked attention's
   four batched products, then the head for one row. ``gemm_fraction`` is GEMM time /
   prefill time (issue 15's goal: ≥ 85%); ``projection_fraction`` leaves the attention
   products out, as this benchmark did before round 2's session 4.
2. **Threads**: the same prefill and the fused batch-64 decode step (64 rows at 1,024
   tokens of context) with 1 and 2 torch threads, in isolation (nothing else running).

fp32 and bf16 weights. Writes ``bench/results/prefill.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, time_ms, write_json
from linserve.model.architectures.own_model import LanguageModel, load_model
from linserve.model.state import State


def gemm_ms(model: LanguageModel, tokens: int, dtype: torch.dtype,
            attention: bool = True) -> float:
    """The prefill's matrix products alone, with the model's shapes and dtype: the
    projections and the head, and with ``attention`` each layer's chunked attention products
    too (four fp32 batched products of C×C or C×F blocks per head and chunk: scores, scores
    times values, queries times the carried state, and the chunk's own keys times values),
    as the step's limit in ``bench.step`` counts its attention products."""
    cfg = model.cfg
    d, f, t = cfg.d_model, cfg.d_ff, tokens
    x, h = torch.randn(t, d, dtype=dtype), torch.randn(t, f, dtype=dtype)
    weights = [torch.randn(d, n, dtype=dtype) for n in (3 * d, d, f)]
    down = torch.randn(f, d, dtype=dtype)
    head = torch.randn(d, cfg.vocab_size, dtype=dtype)
    c = cfg.chunk_size
    blocks = cfg.n_heads * -(-t // c)  # heads x chunks
    qc = torch.randn(blocks, c, cfg.feature_dim)
    kt = torch.randn(blocks, cfg.feature_dim, c)
    vc = torch.randn(blocks, c, cfg.head_dim)
    scores = torch.randn(blocks, c, c)
    state = torch.randn(blocks, cfg.feature_dim, cfg.head_dim)

    def run() -> None:
        for _ in range(cfg.n_layers):
            for w in weights:
                x @ w
            h @ down
            if attention and model.cfg.is_recurrent:
                qc @ kt, scores @ vc, qc @ state, kt @ vc
        x[-1:] @ head

    return time_ms(run, min_seconds=1.0)


def prefill_ms(model: LanguageModel, tokens: int) -> float:
    ids = torch.randint(100, 8000, (1, tokens))
    with torch.no_grad():
        return time_ms(lambda: model.prefill(ids), min_seconds=1.0)


def step_ms(model: LanguageModel, batch: int, context: int) -> float:
    with torch.no_grad():
        _, one = model.prefill(torch.randint(100, 8000, (1, context)))
        state = State.cat([one.copy() for _ in range(batch)])
        ids = torch.randint(100, 8000, (batch,))
        return time_ms(lambda: model.step(ids, state), min_seconds=1.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights/linear"))
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--output", default="prefill")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_model(args.weights, dtype)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pre, gemm = prefill_ms(model, args.tokens), gemm_ms(model, args.tokens, dtype)
            proj = gemm_ms(model, args.tokens, dtype, attention=False)
            rows.append({"dtype": name, "threads": threads, "prefill_ms": pre,
                         "gemm_ms": gemm, "gemm_fraction": gemm / pre,
                         "projection_gemm_ms": proj, "projection_fraction": proj / pre,
                         "prefill_tok_s": args.tokens / pre * 1000,
                         "step_b64_ms": step_ms(model, 64, 1024)})
    print_table(rows, ["dtype", "threads", "prefill_ms", "gemm_ms", "gemm_fraction",
                       "projection_fraction", "prefill_tok_s", "step_b64_ms"])
    print(write_json(args.output, {"machine": machine(), "tokens": args.tokens,
                                   "rows": rows}))


if __name__ == "__main__":
    main()
