"""``python -m bench.verify_ab --libs BEFORE.so AFTER.so``: a verify's cost T(k+1) ÷ T(1)
(``bench.spec_decode.verify_costs``) under two kernel builds, each weight kind in its own
process per library (``LINSERVE_KERNEL_LIB``), alternately, so that both see the same VM
drift. Never run by CI. Writes ``bench/results/spec_verify_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import machine, print_table, write_json

_ONE = ("import json, sys; from pathlib import Path; from bench.spec_decode import verify_costs; "
        "print('ROW', json.dumps(verify_costs(Path(sys.argv[1]), sys.argv[2])))")


def one(lib: str, checkpoint: Path, quant: str) -> dict[str, Any]:
    """One process's row of verify costs with ``lib`` loaded."""
    env = dict(os.environ, LINSERVE_KERNEL_LIB=lib)
    out = subprocess.run([sys.executable, "-c", _ONE, str(checkpoint), quant], env=env,
                         capture_output=True, text=True, check=True).stdout
    row: dict[str, Any] = json.loads(next(x for x in out.splitlines() if x.startswith("ROW"))[4:])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--libs", nargs=2, required=True, help="the kernel builds: before, after")
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"))
    p.add_argument("--kinds", nargs="+", default=["none", "int8", "int4"])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    rows = []
    for rnd in range(args.rounds):
        for quant in args.kinds:
            for name, lib in zip(("before", "after"), args.libs, strict=True):
                rows.append({**one(lib, args.checkpoint, quant), "lib": name, "round": rnd})
                print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    write_json("spec_verify_ab", {"machine": machine(), "libs": args.libs, "rows": rows})


if __name__ == "__main__":
    main()
