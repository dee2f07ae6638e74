"""``python -m bench.latency``: single-client latency through HTTP against the raw model.

In one run: the raw batch-1 ``step`` time, the raw parallel prefill of a 1,000-token prompt,
and stepping the same prompt token by token (in-process); then, against the real server,
one client's median inter-token latency and its time to first token for that prompt.
Reports the ratios the serving issue sets goals for.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from bench.common import machine, time_ms, write_json
from bench.serverproc import ServerProcess
from linserve.model.architectures.own_model import load_model


def raw(weights: Path, prompt: list[int], threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    model = load_model(weights)
    x = torch.tensor([prompt])
    _, state = model.prefill(x)
    tok = torch.tensor([prompt[-1]])

    @torch.inference_mode()
    def one_step() -> None:  # in place, as the server steps (a KV cache is rewound after)
        model.step(tok, state)
        state.lengths -= 1

    step_ms = time_ms(one_step, min_seconds=1.0)
    prefill_ms = time_ms(lambda: model.prefill(x), min_iters=5)

    def stepwise() -> None:
        st = model.new_state(1)
        for t in prompt:
            model.step(torch.tensor([t]), st)

    stepped_ms = time_ms(stepwise, min_iters=2, min_seconds=0.5)
    return {"step_b1_ms": step_ms, "prefill_1000_ms": prefill_ms,
            "stepwise_1000_ms": stepped_ms, "prefill_speedup": stepped_ms / prefill_ms}


def over_http(url: str, prompt: list[int], n_tokens: int, repeats: int) -> dict[str, float]:
    gaps, ttfts = [], []
    with httpx.Client(timeout=120) as c:
        for _ in range(repeats):
            body = {"prompt": prompt, "max_tokens": n_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0}
            t0 = time.perf_counter()
            last = None
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if not json.loads(line[6:])["choices"]:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttfts.append((now - t0) * 1000)
                    else:
                        gaps.append((now - last) * 1000)
                    last = now
    return {"itl_p50_ms": float(np.median(gaps)), "ttft_p50_ms": float(np.median(ttfts))}


def measure(weights: Path, prompt: list[int], threads: int, repeats: int) -> dict[str, Any]:
    """Every figure of one model: raw in-process timings, then through its own server."""
    res: dict[str, Any] = {"weights": str(weights), **raw(weights, prompt, threads)}
    with ServerProcess(weights, args=["--threads", str(threads)]) as srv:
        res |= over_http(srv.url, prompt, 128, repeats)
    res["itl_over_step"] = res["itl_p50_ms"] / res["step_b1_ms"]
    res["ttft_over_prefill"] = res["ttft_p50_ms"] / res["prefill_1000_ms"]
    return res


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, nargs="+",
                   default=[Path("weights/linear"), Path("weights/softmax")],
                   help="models measured one after the other in this one run")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default="latency")
    args = p.parse_args(argv)
    prompt = [(i * 7919) % 8000 + 100 for i in range(args.prompt_tokens)]
    rows = [measure(w, prompt, args.threads, args.repeats) for w in args.weights]
    for row in rows:
        print(row["weights"])
        for k, v in row.items():
            if isinstance(v, float):
                print(f"  {k:20s} {v:10.3f}")
    write_json(args.output, {"machine": machine(), "threads": args.threads, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
