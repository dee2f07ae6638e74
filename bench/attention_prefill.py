"""``python -m bench.attention_prefill``: one attention layer's prefill of a long prompt, in
the server's chunks, by each form (never run by CI).

A ``--tokens``-token prompt at an attention layer's shape (``--shapes``: LFM2-1.2B's, the same
as Granite-4.0-H-Micro's, 32 query heads of 64 and 8 key-value heads; Qwen3.5-0.8B's, 8 of
256 and 2), prefilled in ``--chunk``-token chunks as the engine
does: chunk c's queries attend the cache's first (c + 1) chunks, causally. Per form, the
milliseconds for the whole prompt (its chunks in turn), timed in alternating rounds:

- ``native``: ``invariant.attention`` as the server runs it (``attend_causal``, each row
  over its own keys; batch- and split-invariant);
- ``matrix``: the form it replaced (BENCHMARKS.md §48): per key-value group the scores as
  one invariant GEMM, then masked, max-subtracted, exponentiated, summed and divided in
  elementwise passes over the score matrix, and a second GEMM with the values;
- ``sdpa``: ATen's ``scaled_dot_product_attention`` (fastest on CPU, but a row's bits
  depend on the call, so the server does not use it in this mode).

``gmacs``: multiply-adds of the causal work (each row's keys, q·k and p·v) per second.
Writes ``bench/results/attention_prefill.json``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import machine, print_table, time_interleaved, write_json
from linserve.model import invariant, kernels

SHAPES = {"lfm2-1.2b": (32, 8, 64), "qwen3.5-0.8b": (8, 2, 256)}


def matrix_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
                ) -> torch.Tensor:
    """The replaced form: q ``[1, H, T, D]``, k, v ``[1, Hkv, S, D]`` -> ``[1, H, T, D]``."""
    _, h, t, d = q.shape
    groups = k.shape[1]
    rep = h // groups
    mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(start).repeat(rep, 1)
    out = torch.empty_like(q)
    for g in range(groups):
        rows = q[0, g * rep : (g + 1) * rep].reshape(rep * t, d)
        scores = torch.ops.linserve.invariant_mm(k[0, g].contiguous(),
                                                 rows.t().contiguous()).t() * d ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        e = invariant.rowwise(torch.exp, scores - scores.amax(-1, keepdim=True))
        p = (e / invariant.sum_last(e)).contiguous()
        out[0, g * rep : (g + 1) * rep] = torch.ops.linserve.invariant_mm(
            p, v[0, g].contiguous()).view(rep, t, -1)
    return out


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def prompt(form: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> None:
    """The whole prompt, chunk after chunk, each over the cache so far."""
    for c0 in range(0, q.shape[2], chunk):
        c1 = min(c0 + chunk, q.shape[2])
        form(q[:, :, c0:c1], k[:, :, :c1], v[:, :, :c1], c0)


FORMS = {"native": invariant.attention, "matrix": matrix_form, "sdpa": sdpa}


def measure(name: str, tokens: int, chunk: int, rounds: int, forms: list[str]
            ) -> dict[str, Any]:
    heads, groups, dim = SHAPES[name]
    torch.manual_seed(0)
    q = torch.randn(1, heads, tokens, dim)
    k, v = torch.randn(1, groups, tokens, dim), torch.randn(1, groups, tokens, dim)
    runs = {f: functools.partial(prompt, FORMS[f], q, k, v, chunk) for f in forms}
    ms = time_interleaved(runs, rounds=rounds, round_seconds=0.5, warmup=1)
    macs = heads * dim * 2 * tokens * (tokens + 1) / 2
    return {"shape": name, "tokens": tokens, "chunk": chunk,
            **{f"{f}_ms": ms[f] for f in forms},
            **{f"{f}_gmacs": macs / ms[f] / 1e6 for f in forms},
            **{f"{f}_over_native": ms[f] / ms["native"] for f in forms
               if f != "native" and "native" in forms}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS),
                   help="the forms to time (matrix and sdpa hold a score matrix: leave them "
                   "out past 8k tokens)")
    p.add_argument("--out", default="attention_prefill")
    args = p.parse_args()
    assert kernels.load(), kernels.load_error()
    torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for name in args.shapes:
            for tokens in args.tokens:
                rows.append(measure(name, tokens, args.chunk, args.rounds, args.forms))
                print_table(rows[-1:], list(rows[-1]))
    write_json(args.out, {"command": "python -m bench.attention_prefill",
                                     "machine": machine(), "threads": args.threads,
                                     "rows": rows})


if __name__ == "__main__":
    main()
