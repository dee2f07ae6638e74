"""``python -m bench.loadtest``: a load tester for any OpenAI-compatible streaming server.

Virtual users send streaming ``/v1/completions`` (or ``/v1/chat/completions``) requests,
all at once or with Poisson arrivals, and the tool reports p50/p90/p99/mean of time to first
token, inter-token latency (gap between streamed chunks, as vLLM's benchmark counts it), time
per output token and end-to-end latency, plus output tokens/s, requests/s and errors by kind.
Tokens are counted from the server's ``usage`` (``include_usage``), else from chunks.
``--sessions`` makes each virtual user continue its own session (this server's extension).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from tqdm import tqdm

WORDS = ("the and to of I you my a that in is not with it for be his this your me have "
         "he but as thou so will what him her do by all shall thee lord our no good now sir "
         "if come more love they would are was king let well then how here at their").split()


@dataclass
class Result:
    ok: bool
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def make_prompt(rng: random.Random, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of common words (the usage field reports the exact count)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens)))


def build_body(args: argparse.Namespace, prompt: str, session: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if session:
        body["session_id"] = session
    return body


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Result:
    start = time.perf_counter()
    res = Result(ok=False)
    last, chunks = None, 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"http_{r.status_code}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res.ok = True
                    break
                chunk = orjson.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                chunks += 1
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        res.error = type(exc).__name__
    res.e2e = time.perf_counter() - start
    if not res.ok and not res.error:
        res.error = "no_done"
    res.output_tokens = res.output_tokens or chunks
    return res


async def virtual_user(uid: int, args: argparse.Namespace, client: httpx.AsyncClient,
                       jobs: asyncio.Queue[int], results: list[Result], bar: tqdm) -> None:
    rng = random.Random(args.seed * 1000 + uid)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    session = None
    if args.sessions:
        r = await client.post(args.url + "/v1/sessions", json={})
        session = r.json().get("id") if r.status_code == 200 else None
    while True:
        try:
            await jobs.get()
        except asyncio.CancelledError:
            return
        body = build_body(args, make_prompt(rng, args.prompt_tokens), session)
        results.append(await one_request(client, args.url + path, body))
        bar.update(1)
        jobs.task_done()


async def feed(jobs: asyncio.Queue[int], args: argparse.Namespace, stop_at: float) -> None:
    """Put request tickets in the queue: all at once, or as a Poisson process."""
    rng = np.random.default_rng(args.seed)
    n = 0
    while (args.requests is None or n < args.requests) and time.perf_counter() < stop_at:
        await jobs.put(n)
        n += 1
        if args.request_rate:
            await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        elif jobs.qsize() >= args.concurrency * 2:
            await asyncio.sleep(0.01)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    jobs: asyncio.Queue[int] = asyncio.Queue()
    results: list[Result] = []
    total = args.requests if args.requests is not None else None
    bar = tqdm(total=total, desc="requests", dynamic_ncols=True)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        start = time.perf_counter()
        stop_at = start + (args.duration or 1e12)
        users = [asyncio.create_task(virtual_user(i, args, client, jobs, results, bar))
                 for i in range(args.concurrency)]
        await feed(jobs, args, stop_at)
        while not jobs.empty() or len(results) < (args.requests or 0):
            if time.perf_counter() > stop_at + args.timeout:
                break
            await asyncio.sleep(0.05)
        await jobs.join() if args.duration is None else None
        for u in users:
            u.cancel()
        await asyncio.gather(*users, return_exceptions=True)
        wall = time.perf_counter() - start
    bar.close()
    return summarise(results, wall, args)


def pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values) * 1000
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "mean": float(arr.mean())}


def summarise(results: list[Result], wall: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "config": {k: str(v) if isinstance(v, Path) else v
                   for k, v in vars(args).items() if k != "api_key"},
        "requests": len(results), "completed": len(ok), "wall_seconds": wall,
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall if wall else 0,
        "requests_per_s": len(ok) / wall if wall else 0,
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in ok])) if ok else 0,
        "ttft_ms": pct([r.ttft for r in ok]), "itl_ms": pct([g for r in ok for g in r.itl]),
        "tpot_ms": pct(tpot), "e2e_ms": pct([r.e2e for r in ok]),
    }


def print_report(rep: dict[str, Any]) -> None:
    print(f"\ncompleted {rep['completed']}/{rep['requests']} in {rep['wall_seconds']:.1f}s; "
          f"errors: {rep['errors'] or 'none'}")
    print(f"output tokens/s: {rep['output_tokens_per_s']:.1f}   "
          f"requests/s: {rep['requests_per_s']:.2f}")
    print(f"{'metric':8s} {'p50':>9s} {'p90':>9s} {'p99':>9s} {'mean':>9s}  (ms)")
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        row = rep[name]
        cells = " ".join(f"{row[k]:9.2f}" if row[k] is not None else f"{'-':>9s}"
                         for k in ("p50", "p90", "p99", "mean"))
        print(f"{name[:-3]:8s} {cells}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="default")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=None, help="total requests (default 64)")
    p.add_argument("--duration", type=float, default=None, help="seconds instead of --requests")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals per second (0: send everything at once)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", action="store_true", help="each user continues its session")
    p.add_argument("--api-key", default="")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if args.requests is None and args.duration is None:
        args.requests = 64
    rep = asyncio.run(run(args))
    print_report(rep)
    if args.output:
        args.output.write_text(json.dumps(rep, indent=2) + "\n")
    return rep


if __name__ == "__main__":
    main()
