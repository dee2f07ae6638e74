"""``python -m bench.warm_start``: a start with the kernels cached, to a healthy ``/health``,
in the two orders of the server's processes (never run by CI).

- ``prelaunched``: ``python -m linserve serve`` as users start it: the engine process is
  forked once the engine's modules are imported, and loads while the HTTP process does its
  own imports and checks (``linserve/server/engine/prelaunch.py``);
- ``after imports``: ``python -m linserve.server.serve``, the same server entered past the
  command, so the engine process is spawned once the HTTP process has its imports and has
  checked the checkpoint (the order before the prelaunch).

Alternately, ``--rounds`` times each, for each ``--model`` (a folder or a GGUF file). Writes
``bench/results/warm_start.json``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import machine, print_table, write_json
from bench.gguf_serve import healthy_after
from bench.serverproc import free_port

ORDERS = {"prelaunched": ["-m", "linserve", "serve"],
          "after imports": ["-m", "linserve.server.serve"]}


def start_seconds(entry: list[str], model: str) -> float:
    """Seconds from the command to a healthy server, which is then stopped."""
    port = free_port()
    started = time.time()
    proc = subprocess.Popen([sys.executable, *entry, "--model", model, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return healthy_after(f"http://127.0.0.1:{port}", started, timeout=300)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["weights/linear"])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for model in args.model:
        times: dict[str, list[float]] = {name: [] for name in ORDERS}
        for _ in range(args.rounds):
            for name, entry in ORDERS.items():
                times[name].append(start_seconds(entry, str(Path(model))))
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"model": model, **{f"{n} s": round(v, 2) for n, v in med.items()},
                     "ratio": round(med["prelaunched"] / med["after imports"], 3),
                     "all": times})
    print_table(rows, ["model", *(f"{n} s" for n in ORDERS), "ratio"])
    write_json("warm_start", {"machine": machine(), "command": "python -m bench.warm_start "
                              + " ".join(argv or sys.argv[1:]), "rows": rows})


if __name__ == "__main__":
    main()
