"""``python -m bench.sampler``: the native sampler (``linserve/model/kernels/sampling.cpp``) against
the eager PyTorch one on the same batch: temperature 0.8 (+ min-p 0.05) rows, vocabulary
8192, 1 thread. Writes ``bench/results/sampler.json``."""

from __future__ import annotations

import argparse

import torch

from bench.common import machine, print_table, time_ms, write_json
from linserve.model import kernels
from linserve.model.sampling import BatchParams, SamplingParams, make_generator, sample


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--output", default="sampler")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not kernels.load():
        raise SystemExit(f"the native kernels are unavailable: {kernels.load_error()}")
    rows = []
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab) * 3
        params = [SamplingParams(temperature=0.8, min_p=0.05) for _ in range(batch)]
        bp = BatchParams.from_params(params)
        gens = [make_generator(i) for i in range(batch)]
        native = time_ms(lambda: sample(logits, bp, gens), min_seconds=0.5)  # noqa: B023
        eager = time_ms(lambda: sample(logits, bp, gens, native=False),  # noqa: B023
                        min_seconds=0.5)
        rows.append({"batch": batch, "native_ms": native, "eager_ms": eager,
                     "speedup": eager / native})
    print_table(rows, ["batch", "native_ms", "eager_ms", "speedup"])
    print(write_json(args.output, {"machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
