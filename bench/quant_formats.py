"""``python -m bench.quant_formats``: one batch-1 product (a GEMV) of a 1,024 × 248,320 weight
(the Qwen3.5-0.8B head) in each stored format of ``linserve/model/kernels/gemm_quant.h`` and
in bf16, two threads: milliseconds and the bytes read a second. Never run by CI."""

from __future__ import annotations

import time

import torch

from linserve.model import kernels

K, N = 1024, 248320


def bench(packed: torch.Tensor, label: str, nbytes: int, repeats: int = 20) -> None:
    """Time ``repeats`` products of one row with ``packed`` and print the rate."""
    x = torch.randn(1, K)
    for _ in range(3):
        torch.ops.linserve.invariant_mm(x, packed)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.ops.linserve.invariant_mm(x, packed)
    dt = (time.perf_counter() - start) / repeats
    print(f"{label:5s} {dt * 1e3:6.2f} ms  {nbytes / dt / 1e9:5.1f} GB/s")


def main() -> None:
    kernels.load()
    torch.set_num_threads(2)
    half = (torch.rand(K // 32, N) * 0.01).half()
    # the K formats' (m_s, m_t, d, e): multipliers in [0, 63], each super-block's d and e
    mult = torch.randint(0, 64, (2, K // 32, N)).float()
    pairs = torch.rand(2, K // 256, N).repeat_interleave(8, dim=1)
    pair = torch.cat([mult, pairs])
    cases = [(1, "int4", torch.randint(-8, 8, (K, N), dtype=torch.int8), half),
             (2, "q8", torch.randint(-127, 128, (K, N), dtype=torch.int8), half),
             (3, "q4k", torch.randint(0, 16, (K, N), dtype=torch.int8), pair),
             (4, "q8k", torch.randint(0, 32, (K, N), dtype=torch.int8), pair),
             (5, "q6", torch.randint(-32, 32, (K, N), dtype=torch.int8), pair)]
    for fmt, name, q, scales in cases:
        packed = torch.ops.linserve.pack_quantized(q, scales, fmt)
        bench(packed, name, packed.numel())
        del packed
    packed = torch.ops.linserve.pack_weight(torch.randn(K, N).bfloat16())
    bench(packed, "bf16", packed.numel() * 2)


if __name__ == "__main__":
    main()
