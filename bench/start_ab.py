"""``python -m bench.start_ab FILE --base CHECKOUT``: two checkouts' starts on one file,
alternately (the VM's speed drifts within minutes, so one after the other would compare
two machines): each round starts this checkout's server and the base's in turn, times the
command to a healthy ``/health``, then to the first chat reply (one token), and stops it.
Writes ``bench/results/start_ab.json`` with each round and the medians."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import machine, write_json
from bench.serverproc import ROOT, free_port


def start(cwd: Path, model: str) -> tuple[float, float]:
    """(seconds to healthy, seconds to the first reply) of ``python -m linserve serve`` run
    from ``cwd`` (its checkout is the one imported)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "linserve", "serve", model, "--port",
                             str(port), "--threads", "2"], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server from {cwd} exited")
            time.sleep(0.05)
        healthy = time.time() - started
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1})
        r.raise_for_status()
        return healthy, time.time() - started
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--base", type=Path, required=True, help="the other checkout")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    runs: dict[str, list[tuple[float, float]]] = {"this": [], "base": []}
    for _ in range(args.rounds):
        for who, cwd in (("base", args.base), ("this", ROOT)):
            runs[who].append(start(cwd, args.model))
    medians = {who: {"healthy_s": statistics.median(h for h, _ in v),
                     "first_reply_s": statistics.median(f for _, f in v)}
               for who, v in runs.items()}
    write_json("start_ab", {"machine": machine(), "model": args.model, "base": str(args.base),
                            "runs": runs, "medians": medians})
    print(medians)


if __name__ == "__main__":
    main()
