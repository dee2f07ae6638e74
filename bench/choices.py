"""``python -m bench.choices``: what ``n`` costs. Time to first token of a 1,000-token
prompt with n = 1 and n = 8 (streaming; a fresh prompt every time and the prefix cache off,
so each request really prefills), alternated over ``--repeats`` rounds, and the whole
request's time. With the fork, n = 8 prefills once. Writes ``bench/results/choices.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import machine, write_json
from bench.serverproc import ServerProcess


def one(url: str, prompt: list[int], n: int, max_tokens: int) -> dict[str, float]:
    body = {"prompt": prompt, "n": n, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.8}
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and ttft is None and json.loads(line[6:])["choices"]:
                ttft = time.perf_counter() - t0
    return {"ttft_ms": (ttft or 0) * 1000, "total_ms": (time.perf_counter() - t0) * 1000}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights/linear"))
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--output", default="choices")
    args = p.parse_args(argv)
    rng = random.Random(0)
    rows: dict[int, list[dict[str, float]]] = {1: [], 8: []}
    with ServerProcess(args.weights, args=["--prefix-cache-bytes", "0"]) as srv:
        one(srv.url, [5] * 64, 8, 4)  # warm-up
        for _ in range(args.repeats):
            for n in (1, 8):
                prompt = [rng.randrange(100, 8000) for _ in range(args.prompt_tokens)]
                rows[n].append(one(srv.url, prompt, n, args.max_tokens))
    summary: dict[str, Any] = {
        f"n{n}": {k: float(np.median([r[k] for r in rs])) for k in ("ttft_ms", "total_ms")}
        for n, rs in rows.items()}
    summary["ttft_ratio_n8_over_n1"] = summary["n8"]["ttft_ms"] / summary["n1"]["ttft_ms"]
    print(json.dumps(summary, indent=1))
    print(write_json(args.output, {"machine": machine(), "summary": summary,
                                   "rows": {str(k): v for k, v in rows.items()}}))


if __name__ == "__main__":
    main()
