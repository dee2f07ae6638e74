"""``python -m bench.invariance``: what batch invariance costs, in one run.

The engine's scheduling loop (:mod:`bench.engine_loop`, the real engine without HTTP) at 1
and 64 closed-loop clients, for each weight dtype, with the batch-invariant kernels on and
off (``--batch-invariant`` / ``--no-batch-invariant``). The arms alternate ``--rounds``
times and each keeps its best round, so a slow spell of this VM does not land on one arm.
Writes ``bench/results/invariance.json`` and a bar chart.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import engine_loop
from bench.common import RESULTS, machine, print_table, write_json
from linserve.model import modes


def measure(args: argparse.Namespace, dtype: str, clients: int, on: bool) -> float:
    """Tokens/s of the engine loop for one arm."""
    modes.set_enabled(on)
    loop_args = engine_loop.main_parser().parse_args([
        "--weights", str(args.weights), "--clients", str(clients), "--dtype", dtype,
        "--requests", str(max(clients * 2, args.min_requests)),
        "--max-tokens", str(args.max_tokens)])
    return float(engine_loop.run(loop_args)["tokens_per_s"])


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['dtype']}\n{r['clients']} client{'s' if r['clients'] > 1 else ''}"
              for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["off_tok_s"] for r in rows], 0.4, label="ATen GEMMs")
    ax.bar([x + 0.2 for x in xs], [r["on_tok_s"] for r in rows], 0.4,
           label="batch-invariant (default)")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("tokens/s (engine loop)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("The cost of batch invariance")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights/linear"))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--clients", nargs="+", type=int, default=[1, 64])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=8)
    args = p.parse_args(argv)
    rows = []
    for dtype in args.dtypes:
        for clients in args.clients:
            best = {True: 0.0, False: 0.0}
            for _ in range(args.rounds):
                for on in (False, True):
                    best[on] = max(best[on], measure(args, dtype, clients, on))
            rows.append({"dtype": dtype, "clients": clients, "off_tok_s": best[False],
                         "on_tok_s": best[True],
                         "on_over_off": round(best[True] / best[False], 3)})
    modes.set_enabled(True)
    print_table(rows, list(rows[0]))
    write_json("invariance", {"machine": machine(), "args": vars(args) | {
        "weights": str(args.weights)}, "rows": rows})
    plot(rows, RESULTS / "invariance.png")


if __name__ == "__main__":
    main()
