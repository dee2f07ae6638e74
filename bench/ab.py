"""``python -m bench.ab --base DIR``: this checkout against another, alternating, in one run.

For a change that must not cost speed (a refactor): runs ``bench.step`` (the decode step
alone) and ``bench.engine_loop`` (the scheduler without HTTP) at batch 1 and 64 in each
checkout (``--suite native``: ``bench.native_step``, the whole-model native step of each
``--checkpoints`` model, instead), alternating A, B, A, B for ``--rounds`` rounds so that a
slow spell of the machine does not land on one side, and reports each side's best round and
the ratio. Each side builds its kernels into its own extension folder. Writes
``bench/results/ab.json`` (``ab_native.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, print_table, write_json

HERE = Path(__file__).resolve().parents[1]


def _run(root: Path, args: list[str], ext: Path) -> list[dict[str, Any]]:
    """Run ``python -m <args>`` (ending in ``--output NAME``) in ``root``; the rows it wrote
    to its ``bench/results/NAME.json``, which is then removed with its plots."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    subprocess.run([sys.executable, "-m", *args], cwd=root, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    name = args[-1]
    rows = list(json.loads((root / "bench/results" / f"{name}.json").read_text())["rows"])
    for leftover in (root / "bench/results").glob(f"{name}*"):
        leftover.unlink()
    return rows


def measures(batch: int, suite: str = "own", checkpoints: tuple[Path, ...] = ()
             ) -> dict[str, list[str]]:
    """The benches to compare at one batch size: the own model's step and the engine loop
    (``own``), or the whole-model native step of each checkpoint (``native``, int8 weights,
    ``bench.native_step``)."""
    if suite == "native":
        return {f"native {c.name} b{batch}": [
            "bench.native_step", "--checkpoint", str(c.resolve()), "--kind", "int8",
            "--batches", str(batch), "--output", "ab_native"] for c in checkpoints}
    return {
        f"step b{batch}": ["bench.step", "--kinds", "gated", "--batches", str(batch),
                           "--contexts", "1024", "--threads", "1", "--dtypes", "bf16",
                           "--output", "ab_step"],
        f"engine_loop b{batch}": ["bench.engine_loop", "--clients", str(batch),
                                  "--requests", str(max(2 * batch, 8)), "--max-tokens", "128",
                                  "--output", "ab_loop"],
    }


def rate(rows: list[dict[str, Any]]) -> float:
    """Tokens/s of the (single) measured row."""
    return float(next(r for r in rows if r.get("tokens_per_s"))["tokens_per_s"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the other checkout (A)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--suite", choices=["own", "native"], default="own")
    p.add_argument("--checkpoints", nargs="*", type=Path, default=[],
                   help="the models of --suite native")
    args = p.parse_args(argv)
    sides = {"A (base)": args.base.resolve(), "B (this)": HERE}
    ext = {name: Path(tempfile.gettempdir()) / f"linserve-ab-{i}" for i, name in enumerate(sides)}
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for batch in args.batches:
            for label, cmd in measures(batch, args.suite, tuple(args.checkpoints)).items():
                for side, root in sides.items():
                    tok_s = rate(_run(root, cmd, ext[side]))
                    best[(label, side)] = max(best.get((label, side), 0.0), tok_s)
    rows = [{"measure": label, "A_tok_s": round(best[(label, "A (base)")], 1),
             "B_tok_s": round(best[(label, "B (this)")], 1),
             "B_over_A": round(best[(label, "B (this)")] / best[(label, "A (base)")], 3)}
            for label in dict.fromkeys(label for label, _ in best)]
    print_table(rows, list(rows[0]))
    write_json("ab" if args.suite == "own" else f"ab_{args.suite}",
               {"machine": machine(), "rows": rows,
                "args": {**vars(args), "base": str(args.base),
                         "checkpoints": [str(c) for c in args.checkpoints]}})


if __name__ == "__main__":
    main()
