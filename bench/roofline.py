"""``python -m bench.roofline``: where the decode step sits against this machine's measured
ceilings (a real roofline, not a loop of the step's own products).

1. The ceilings, measured on 1 thread: peak fp32 and bf16 GEMM FLOP/s (a large square
   matmul) and two bandwidths (a copy, counting bytes read + written): DRAM (512 MiB) and the
   last-level cache (a copy whose two buffers fill half of it). A step whose bytes fit in
   the last-level cache is held to the cache ceiling (repeated steps re-read from there).
2. For each decode step (linear at any context, softmax at ``--context``; batches 1–64):
   its FLOPs and the bytes it must move at least once (every weight, plus per row the state
   it reads and writes: the linear s and z, or the softmax K and V up to the context). The
   roofline time is max(FLOPs / peak, bytes / bandwidth); the step is timed in the same run,
   and ``of roofline`` = roofline time / step time (1.0 would be the hardware bound).

Writes ``bench/results/roofline.json`` and ``roofline.png``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import machine, print_table, save_figure, style_axes, time_ms, write_json
from bench.step import build, state_at, step_fns
from linserve.model.own_config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def peak_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    """Best-of GFLOP/s of an n×n×n matmul (the machine's practical compute ceiling)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def bandwidth_gbs(mib: int = 512) -> float:
    """Best-of GB/s of a large copy, counting the bytes read and the bytes written."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


# A read as fast as this machine reads: four independent streams of a thread's share, each
# summed in 16-lane vectors and prefetched 1 KiB ahead (as a GEMV's weight panels are read).
# ATen's reductions read one stream with one dependency chain and leave bandwidth unused:
# 18.5 GB/s on one thread where the best of them read 14 (the AMX Xeon).
_READ_SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>
double stream_read(const torch::Tensor& t) {
  typedef float v16 __attribute__((vector_size(64)));
  const float* p = t.data_ptr<float>();
  const int64_t vecs = t.numel() / 16;
  std::vector<double> part(at::get_num_threads(), 0.0);
  at::parallel_for(0, vecs, 4096, [&](int64_t b, int64_t e) {
    const int64_t q = (e - b) / 4;
    const float* s[4];
    for (int j = 0; j < 4; ++j) s[j] = p + (b + j * q) * 16;
    v16 acc[4][2] = {};
    for (int64_t i = 0; i + 1 < q; i += 2) {
      for (int j = 0; j < 4; ++j) {
        __builtin_prefetch(s[j] + (i + 16) * 16, 0, 3);
        v16 v, w;
        std::memcpy(&v, s[j] + i * 16, 64);
        std::memcpy(&w, s[j] + i * 16 + 16, 64);
        acc[j][0] += v;
        acc[j][1] += w;
      }
    }
    double total = 0.0;
    for (auto& a : acc) for (int l = 0; l < 16; ++l) total += a[0][l] + a[1][l];
    part[at::get_thread_num()] += total;
  });
  double total = 0.0;
  for (double x : part) total += x;
  return total;
}
"""


def stream_read() -> Any:
    """The native four-stream read (compiled once, cached by torch's extension builder), a
    function of an fp32 tensor; None when it cannot be built."""
    from torch.utils import cpp_extension

    try:
        mod = cpp_extension.load_inline(
            "linserve_read_probe", _READ_SOURCE, functions=["stream_read"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except (RuntimeError, OSError):
        return None
    return mod.stream_read


def read_bandwidth_gbs(mib: int = 512, threads: int = 1) -> float:
    """Best-of GB/s of ``threads`` threads reading a large buffer once: the ceiling of a
    batch-1 decode step, which reads its weights and writes almost nothing. The best of five
    read-only kernels (the native four-stream read; ATen's fp32 sum, amax and dot, bf16
    sum), each best of 5: one kernel alone understates it."""
    src = torch.ones(mib * 2**20 // 4)
    half = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16)
    kernels = [(lambda: src.sum(), src), (lambda: src.amax(), src),
               (lambda: torch.dot(src, src), src), (lambda: half.sum(), half)]
    native = stream_read()
    if native is not None:
        kernels.append((lambda: native(src), src))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for fn, t in kernels:
            fn()
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                best = max(best, t.numel() * t.element_size() / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(before)
    return best / 1e9


def llc_bytes() -> int:
    """Size of the last-level cache (index3, else 32 MiB)."""
    from pathlib import Path

    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text.rstrip("K")) * 1024 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 32 * 2**20


def step_cost(cfg: ModelConfig, weight_bytes: int, batch: int, context: int
              ) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step over ``batch`` rows."""
    d, h, hd = cfg.d_model, cfg.n_heads, cfg.head_dim
    macs = cfg.n_layers * (4 * d * d + 2 * d * cfg.d_ff) + d * cfg.vocab_size
    if cfg.is_recurrent:
        f = cfg.feature_dim
        attn_macs = cfg.n_layers * h * 2 * f * hd  # s += φk vᵀ, then φqᵀ s
        state_bytes = cfg.n_layers * h * (f * hd + f) * 4 * 2  # s and z, read and written
    else:
        attn_macs = cfg.n_layers * h * 2 * context * hd  # q·Kᵀ, p·V
        state_bytes = cfg.n_layers * h * context * hd * 4 * 2  # K and V, read
    flops = 2 * batch * (macs + attn_macs)
    return flops, weight_bytes + batch * state_bytes


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    llc = llc_bytes()
    ceilings = {"fp32_gflops": peak_gflops(torch.float32),
                "bf16_gflops": peak_gflops(torch.bfloat16), "bandwidth_gbs": bandwidth_gbs(),
                "llc_bytes": llc, "llc_bandwidth_gbs": bandwidth_gbs(llc // 2**22)}
    print(ceilings, flush=True)
    rows = []
    for kind in ("linear", "softmax"):
        for dname in args.dtypes:
            model = build(kind, DTYPES[dname], args.context + 2, fused=True)
            wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            peak = ceilings[f"{dname}_gflops"]
            for batch in args.batches:
                ctx = args.context
                flops, nbytes = step_cost(model.cfg, wbytes, batch, ctx)
                ms = time_ms(step_fns(model, state_at(model, batch, ctx), batch,
                                      compare_eager=False)["step"])
                bw = ceilings["llc_bandwidth_gbs" if nbytes <= llc else "bandwidth_gbs"]
                roof_ms = max(flops / peak / 1e6, nbytes / bw / 1e6)
                rows.append({
                    "kind": kind, "dtype": dname, "batch": batch, "context": ctx,
                    "gflop": flops / 1e9, "mbytes": nbytes / 1e6,
                    "intensity": flops / nbytes, "step_ms": ms,
                    "step_gflops": flops / ms / 1e6, "roofline_ms": roof_ms,
                    "bound": "compute" if flops / peak > nbytes / bw
                    else ("cache" if nbytes <= llc else "memory"), "of_roofline": roof_ms / ms})
                print(rows[-1], flush=True)
    return {"machine": machine(), "ceilings": ceilings, "rows": rows}


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = result["ceilings"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [2**i / 8 for i in range(0, 10)]
    for name, style in (("fp32", "-"), ("bf16", "--")):
        peak = ceil[f"{name}_gflops"]
        ax.plot(xs, [min(peak, x * ceil["bandwidth_gbs"]) for x in xs], "k" + style,
                lw=1, label=f"roofline {name} ({peak:.0f} GFLOP/s, DRAM "
                f"{ceil['bandwidth_gbs']:.0f} GB/s)")
        ax.plot(xs, [min(peak, x * ceil["llc_bandwidth_gbs"]) for x in xs], "g" + style,
                lw=0.8, label=f"{name} from cache ({ceil['llc_bandwidth_gbs']:.0f} GB/s)")
    markers = {"linear": "o", "softmax": "s"}
    colors = {"fp32": "tab:blue", "bf16": "tab:orange"}
    for r in result["rows"]:
        ax.scatter(r["intensity"], r["step_gflops"], marker=markers[r["kind"]],
                   color=colors[r["dtype"]], s=18 + 4 * r["batch"] ** 0.5)
        ax.annotate(f"{r['kind'][0]}{r['batch']}", (r["intensity"], r["step_gflops"]),
                    fontsize=6, xytext=(3, 2), textcoords="offset points")
    style_axes(ax, "arithmetic intensity (FLOP / byte)", "GFLOP/s",
               "decode step vs measured roofline (1 thread)\n"
               "l = linear, s = softmax (4k context); number = batch; blue fp32, orange bf16")
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    save_figure(fig, "roofline.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--context", type=int, default=4096,
                   help="context of the softmax step (linear does not depend on it)")
    p.add_argument("--output", default="roofline")
    args = p.parse_args(argv)
    result = measure(args)
    print_table(result["rows"], ["kind", "dtype", "batch", "gflop", "mbytes", "intensity",
                                 "bound", "roofline_ms", "step_ms", "of_roofline"])
    path = write_json(args.output, result)
    plot(result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
