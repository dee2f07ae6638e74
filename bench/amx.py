"""``python -m bench.amx``: the engine's GEMMs on AMX tiles against the AVX-512 dot products,
in one process, alternating (never run by CI; needs a CPU with AMX).

For each weight type (bf16, int8, int4) a real checkpoint (default: the Qwen3.5-0.8B
shapes of ``bench.hf``) is loaded once with ``--threads`` threads, and three things are timed
with the tiles on and off (``torch.ops.linserve.set_amx``), in alternating rounds
(``bench.common.time_interleaved``) so that the VM's bandwidth drift hits both alike:

- the decode step at batch 1 and at ``--batch`` rows (after a 64-token prefill);
- the prefill of one ``--prompt``-token prompt.

Writes ``bench/results/amx.json`` and ``amx.png`` (a run of some ``--kinds`` replaces those
kinds' rows and keeps the others'). ``--gemm`` times the int8 / int4 GEMM alone instead
(``--gemm-shape`` K N, at 16 to 256 rows; gemm_quant_amx.h against vpdpbusd, the same bits)
and writes ``amx_gemm.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, save_figure, time_interleaved, write_json

QUANT = {"bf16": "none", "int8": "int8", "int4": "int4"}


def _switch(on: bool) -> None:
    torch.ops.linserve.set_amx(on)


def measure(path: Path, kind: str, batch: int, prompt: int) -> dict[str, Any]:
    """Milliseconds of each measure with the tiles on and off, and the speedups."""
    from linserve.model import loader

    model = loader.load(path, "bfloat16", quantization=QUANT[kind])
    vocab = min(model.info.vocab_size, 1000)
    row: dict[str, Any] = {"kind": kind}
    for rows in (1, batch):
        _, state = model.prefill(torch.randint(0, vocab, (rows, 64)))
        tokens = torch.randint(0, vocab, (rows,))

        def step(on: bool, tokens: torch.Tensor = tokens, state: Any = state) -> None:
            _switch(on)
            model.step(tokens, state)

        times = time_interleaved({"amx": lambda: step(True), "avx512": lambda: step(False)},
                                 rounds=5, round_seconds=0.5)
        row[f"step_b{rows}"] = {**times, "speedup": times["avx512"] / times["amx"]}
    text = torch.randint(0, vocab, (1, prompt))

    def fill(on: bool) -> None:
        _switch(on)
        model.prefill(text)

    times = time_interleaved({"amx": lambda: fill(True), "avx512": lambda: fill(False)},
                             rounds=3, round_seconds=0.0, warmup=1)
    row[f"prefill_{prompt}"] = {**times, "speedup": times["avx512"] / times["amx"]}
    _switch(True)
    print(kind, {k: round(v["speedup"], 2) for k, v in row.items() if k != "kind"}, flush=True)
    return row


def measure_gemm(k: int, n: int, rows_list: list[int]) -> list[dict[str, Any]]:
    """GFLOP/s of one quantized product per weight type and row count, tiles on and off."""
    from linserve.model import quantize

    out = []
    for kind in ("int8", "int4"):
        w = quantize.pack(torch.randn(k, n), kind)
        for rows in rows_list:
            x = torch.randn(rows, k)

            def mm(on: bool, x: torch.Tensor = x, w: torch.Tensor = w) -> None:
                _switch(on)
                torch.ops.linserve.invariant_mm(x, w)

            times = time_interleaved({"amx": lambda: mm(True), "avx512": lambda: mm(False)},
                                     rounds=7, round_seconds=0.2)
            flops = 2 * rows * k * n
            row = {"kind": kind, "rows": rows, "k": k, "n": n,
                   **{f"{name}_gflops": flops / ms / 1e6 for name, ms in times.items()},
                   "speedup": times["avx512"] / times["amx"]}
            print(row, flush=True)
            out.append(row)
    _switch(True)
    return out


def merged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """These rows, and the stored run's rows of the kinds not measured now."""
    from bench.common import RESULTS

    path = RESULTS / "amx.json"
    if not path.exists():
        return rows
    import json

    old = json.loads(path.read_text()).get("rows", [])
    kinds = {r["kind"] for r in rows}
    keep = [r for r in old if r["kind"] not in kinds]
    order = list(QUANT)
    return sorted(keep + rows, key=lambda r: order.index(r["kind"]))


def plot(rows: list[dict[str, Any]]) -> None:
    """Speedup of the tiles per weight type and measure."""
    import matplotlib.pyplot as plt

    measures = [k for k in rows[0] if k != "kind"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [m + i * width for m in range(len(measures))]
        ax.bar(xs, [row[m]["speedup"] for m in measures], width, label=row["kind"])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([m + width * (len(rows) - 1) / 2 for m in range(len(measures))], measures)
    ax.set_ylabel("AMX tiles ÷ AVX-512 (speedup)")
    ax.set_title("Engine GEMMs on AMX tiles, Qwen3.5-0.8B shapes, same process")
    ax.legend()
    save_figure(fig, "amx")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"))
    p.add_argument("--kinds", nargs="+", default=list(QUANT), choices=list(QUANT))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gemm", action="store_true", help="time the quantized GEMM alone")
    p.add_argument("--gemm-shape", type=int, nargs=2, default=[2048, 4096], metavar=("K", "N"))
    p.add_argument("--gemm-rows", type=int, nargs="+", default=[16, 32, 64, 256])
    args = p.parse_args(argv)
    from linserve.model import kernels

    if not (kernels.load() and torch.ops.linserve.amx_active()):
        raise SystemExit("AMX tiles are not active here (no AMX, or LINSERVE_AMX=0)")
    torch.set_num_threads(args.threads)
    command = "python -m bench.amx " + " ".join(argv or sys.argv[1:])
    if args.gemm:
        k, n = args.gemm_shape
        gemm = measure_gemm(k, n, args.gemm_rows)
        write_json("amx_gemm", {"command": command, "machine": machine(),
                                "threads": args.threads, "rows": gemm})
        return
    rows = merged([measure(args.checkpoint, kind, args.batch, args.prompt)
                   for kind in args.kinds])
    write_json("amx", {"command": command, "machine": machine(), "threads": args.threads,
                       "rows": rows})
    plot(rows)


if __name__ == "__main__":
    main()
