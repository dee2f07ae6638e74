"""``python -m bench.product_split CHECKPOINT``: where a batched prefill's time goes, by matrix
product (never run by CI).

Loads a checkpoint as the server does (a GGUF file or a folder), then times one ragged
prefill of ``--prompts`` prompts of ``--tokens`` random tokens each (``prefill_ragged``, as
the engine prefills several waiting prompts in one iteration) with every call of the
invariant GEMM timed: by (inputs K, outputs N, the weight's stored format, rows), the calls,
seconds, share of the prefill and GMAC/s. What is left is the rest of the prefill (the
recurrent scans, attention, norms, activations). Also the fused decode step of ``--rows``
rows after 128 tokens (:func:`bench.concurrency.step_ms`), whose products run inside the
native step and are not split. BENCHMARKS.md §74 has a
run: a 16-stream benchmark's prompts spend four fifths of their prefill in these products.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch

from bench.concurrency import step_ms
from linserve.model import kernels, loader, quantize
from linserve.model.interface import ServedModel


def timed_products(stats: dict[tuple[int, int, str, int], list[float]]) -> object:
    """Replaces ``torch.ops.linserve.invariant_mm`` with a wrapper that adds each call's
    time and multiply-adds to ``stats``; returns the original, to put back."""
    original = torch.ops.linserve.invariant_mm

    def timed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = original(x, w)
        seconds = time.perf_counter() - t0
        k, n, rows = x.shape[1], y.shape[-1], x.shape[0]
        cell = stats.setdefault((k, n, quantize.mode_of(w, k), rows), [0, 0.0, 0.0])
        cell[0] += 1
        cell[1] += seconds
        cell[2] += rows * k * n
        return y

    setattr(torch.ops.linserve, "invariant_mm", timed)  # noqa: B010 (an op namespace)
    return original


def prefill_split(model: ServedModel, prompts: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 8000, (tokens,), generator=gen).tolist() for _ in range(prompts)]
    model.prefill_ragged(batch, [None] * prompts)  # warm
    stats: dict[tuple[int, int, str, int], list[float]] = collections.OrderedDict()
    original = timed_products(stats)
    try:
        t0 = time.perf_counter()
        model.prefill_ragged(batch, [None] * prompts)
        total = time.perf_counter() - t0
    finally:
        setattr(torch.ops.linserve, "invariant_mm", original)  # noqa: B010
    products = sum(cell[1] for cell in stats.values())
    print(f"prefill of {prompts} x {tokens} tokens: {total:.3f} s "
          f"({prompts * tokens / total:.1f} tokens/s); products {products:.3f} s "
          f"({products / total:.0%}), the rest {total - products:.3f} s")
    print(f"{'K':>6} {'N':>7} {'format':>7} {'rows':>5} {'calls':>5} {'s':>7} {'share':>6} GMAC/s")
    for (k, n, fmt, rows), (calls, seconds, macs) in sorted(stats.items(),
                                                           key=lambda kv: -kv[1][1]):
        print(f"{k:6d} {n:7d} {fmt:>7} {rows:5d} {calls:5d} {seconds:7.3f} "
              f"{seconds / total:6.1%} {macs / seconds / 1e9:6.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a GGUF file or a checkpoint folder")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rows", type=int, default=16, help="the decode step's rows")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit(f"the native kernels did not load: {kernels.load_error()}")
    model = loader.load(args.checkpoint, "auto", batch_invariant=True)
    prefill_split(model, args.prompts, args.tokens)
    print(f"decode step of {args.rows} rows: {step_ms(model, args.rows, 128):.1f} ms")


if __name__ == "__main__":
    main()
