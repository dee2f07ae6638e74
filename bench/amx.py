"""``python -m bench.amx``: the engine's GEMMs on AMX tiles against the AVX-512 dot products,
in one process, alternating (never run by CI; needs a CPU with AMX).

For each weight type (bf16, int8, int4) a real checkpoint (default: the Qwen3.5-0.8B
shapes of ``bench.hf``) is loaded once with ``--threads`` threads, and three things are timed
with the tiles on and off (``torch.ops.linserve.set_amx``), in alternating rounds
(``bench.common.time_interleaved``) so that the VM's bandwidth drift hits both alike:

- the decode step at batch 1 and at ``--batch`` rows (after a 64-token prefill);
- the prefill of one ``--prompt``-token prompt.

Writes ``bench/results/amx.json`` and ``amx.png``.
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
    from model import loader

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
    args = p.parse_args(argv)
    from model import kernels

    if not (kernels.load() and torch.ops.linserve.amx_active()):
        raise SystemExit("AMX tiles are not active here (no AMX, or LINSERVE_AMX=0)")
    torch.set_num_threads(args.threads)
    rows = [measure(args.checkpoint, kind, args.batch, args.prompt) for kind in args.kinds]
    command = "python -m bench.amx " + " ".join(argv or sys.argv[1:])
    write_json("amx", {"command": command, "machine": machine(), "threads": args.threads,
                       "rows": rows})
    plot(rows)


if __name__ == "__main__":
    main()
