"""``python -m bench.multiturn``: stateless multi-turn chat, prefix cache on against off.

Every client here is what chat UIs and agent frameworks are: the openai SDK's
``chat.completions`` with the whole history resent each turn, never a ``session_id``.

1. **TTFT by turn**: one 30-turn conversation (~100-token user turns, replies of up to 100
   tokens), streaming, for linear and softmax, cache on and off (softmax stops where its
   4,096-token context refuses the prompt).
2. **Concurrent conversations** (linear): 16 conversations of 30 turns at once; the share of
   resent prompt tokens served from the cache, TTFT p50 and output tokens/s, on against off.
3. **A short shared system prompt** (40 tokens) before 32 different questions: how many
   requests hit.
4. **Cached conversations per GiB** at 4,000 tokens of history: the bytes of the state a
   cache entry holds after that history, linear against softmax.
5. **No reuse at all**: random prompts through ``bench.loadtest``, tokens/s on against off.
6. **What taking an entry costs** the engine thread, against a batch-64 decode step.
7. **An agent with tools** (``--checkpoint``, a Hugging Face Qwen3.5 folder, e.g. the one
   ``bench.hf --make`` builds): 10 turns of user question, a forced tool call
   (``tool_choice: required``), the tool's result, resent whole each turn; TTFT by turn and
   the ratio of turn 10 to turn 1, cache on against off.

Writes ``bench/results/multiturn.json`` and ``multiturn.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from openai import AsyncOpenAI

from bench import loadtest
from bench.common import RESULTS, machine, save_figure, server_metrics, style_axes, write_json
from bench.serverproc import ServerProcess

LINES = ["Now is the winter of our discontent made glorious summer by this sun of York",
         "and all the clouds that lour'd upon our house in the deep bosom of the ocean buried",
         "Now are our brows bound with victorious wreaths, our bruised arms hung up for",
         "monuments, our stern alarums changed to merry meetings, our dreadful marches to"]


def user_turn(conv: int, turn: int) -> str:
    """About 100 tokens of verse, different for every conversation and turn."""
    body = " ".join(LINES[(conv + turn + i) % 4] for i in range(4))
    return f"Conversation {conv}, turn {turn}: {body}."


async def conversation(client: AsyncOpenAI, conv: int, turns: int, max_tokens: int
                       ) -> list[dict[str, Any]]:
    """One stateless chat; per turn: TTFT, prompt and cached tokens, output tokens."""
    history: list[dict[str, str]] = [{"role": "system", "content": "A room of state."}]
    rows = []
    for turn in range(turns):
        history.append({"role": "user", "content": user_turn(conv, turn)})
        t0 = time.perf_counter()
        ttft, text, usage = None, "", None
        try:
            create: Any = client.chat.completions.create  # messages are plain dicts here
            stream = await create(
                model="m", messages=history, max_tokens=max_tokens, temperature=0.8,
                seed=conv * 1000 + turn, stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and ttft is None:
                    ttft = time.perf_counter() - t0
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    usage = chunk.usage
        except Exception as exc:  # the softmax baseline refuses past its context
            rows.append({"turn": turn + 1, "refused": str(exc)[:120]})
            break
        assert usage is not None
        details = usage.prompt_tokens_details
        rows.append({"turn": turn + 1, "ttft_ms": (ttft or 0) * 1000,
                     "prompt_tokens": usage.prompt_tokens,
                     "cached_tokens": (details.cached_tokens or 0) if details else 0,
                     "output_tokens": usage.completion_tokens})
        history.append({"role": "assistant", "content": text})
    return rows


async def conversations(url: str, n: int, turns: int, max_tokens: int
                        ) -> tuple[list[list[dict[str, Any]]], float]:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                           timeout=600) as client:
        await conversation(client, 10_000, 1, 4)  # warm-up: the first request pays start-up
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(conversation(client, c, turns, max_tokens)
                                       for c in range(n)))
    return list(convs), time.perf_counter() - t0


WEATHER_TOOL: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city on a day",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "day": {"type": "integer", "minimum": 1,
                                                            "maximum": 7}},
        "required": ["city", "day"], "additionalProperties": False}}}


async def agent(client: AsyncOpenAI, turns: int) -> list[dict[str, Any]]:
    """One stateless tool-using conversation: per turn a question, a forced call, its result."""
    history: list[Any] = [{"role": "system", "content": "You answer with tools."}]
    rows = []
    for turn in range(turns):
        history.append({"role": "user", "content": user_turn(0, turn)})
        t0 = time.perf_counter()
        ttft, usage = None, None
        calls: dict[int, dict[str, Any]] = {}
        stream = await client.chat.completions.create(
            model="m", messages=history, tools=[WEATHER_TOOL], tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, seed=turn, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - t0
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and calls
        details = usage.prompt_tokens_details
        rows.append({"turn": turn + 1, "ttft_ms": (ttft or 0) * 1000,
                     "prompt_tokens": usage.prompt_tokens,
                     "cached_tokens": (details.cached_tokens or 0) if details else 0})
        call = calls[0]
        history.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]})
        history.append({"role": "tool", "tool_call_id": call["id"],
                        "content": f"Sunny, {18 + turn} degrees."})
    return rows


def tools(checkpoint: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for on in (True, False):
        with ServerProcess(args.weights / "linear",
                           args=["--model", str(checkpoint), *cache_args(on)]) as srv:
            async def run(url: str = srv.url) -> list[dict[str, Any]]:
                async with AsyncOpenAI(base_url=url + "/v1", api_key="none",
                                       max_retries=0, timeout=900) as client:
                    return await agent(client, 10)
            rows = asyncio.run(run())
        ratio = rows[-1]["ttft_ms"] / rows[0]["ttft_ms"]
        out.append({"cache": on, "turns": rows, "ttft_turn10_over_turn1": ratio})
        print("tools", "cache" if on else "no cache", [round(r["ttft_ms"]) for r in rows],
              f"turn 10 / turn 1 = {ratio:.2f}", flush=True)
    return out


def cache_args(on: bool) -> list[str]:
    return [] if on else ["--prefix-cache-bytes", "0"]


def by_turn(weights: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for on in (True, False):
        with ServerProcess(weights, args=cache_args(on)) as srv:
            convs, _ = asyncio.run(conversations(srv.url, 1, args.turns, args.max_tokens))
        for row in convs[0]:
            out.append({"model": weights.name, "cache": on, **row})
        print(weights.name, "cache" if on else "no cache",
              [round(r.get("ttft_ms", 0)) for r in convs[0]], flush=True)
    return out


def concurrent(weights: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for on in (True, False):
        with ServerProcess(weights, args=cache_args(on)) as srv:
            convs, wall = asyncio.run(conversations(srv.url, args.conversations, args.turns,
                                                    args.max_tokens))
        rows = [r for c in convs for r in c if "ttft_ms" in r]
        resent = [r for r in rows if r["turn"] > 1]
        out.append({"model": weights.name, "cache": on, "requests": len(rows),
                    "ttft_p50_ms": float(np.median([r["ttft_ms"] for r in rows])),
                    "ttft_p90_ms": float(np.percentile([r["ttft_ms"] for r in rows], 90)),
                    "output_tokens_per_s": sum(r["output_tokens"] for r in rows) / wall,
                    "cached_share_of_resent": sum(r["cached_tokens"] for r in resent)
                    / max(1, sum(r["prompt_tokens"] for r in resent)),
                    "resent_share_of_history": _resent_history_share(resent)})
        print(out[-1], flush=True)
    return out


def _resent_history_share(rows: list[dict[str, Any]]) -> float:
    """Cached tokens / the tokens of the history the client resent (all but the new user
    message and the chat cue, ~100 tokens a turn): how much of what could hit, did."""
    history = sum(max(0, r["prompt_tokens"] - 110) for r in rows)
    return sum(min(r["cached_tokens"], r["prompt_tokens"]) for r in rows) / max(1, history)


def shared_system_prompt(weights: Path) -> dict[str, Any]:
    system = ("You are the herald of the court of Denmark. Answer every question in verse, "
              "briefly, in the manner of the plays, and name the speaker of each line first, "
              "as the printed editions do.")
    with ServerProcess(weights) as srv:
        client = httpx.Client(base_url=srv.url, timeout=120)
        n_system = len(client.post("/tokenize", json={"prompt": system}).json()["tokens"])
        cached = []
        for i in range(32):
            r = client.post("/v1/chat/completions", json={"max_tokens": 8, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"What news of the {i}th legion?"}]}).json()
            cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    hits = sum(c >= n_system for c in cached)
    print("shared system prompt:", n_system, "tokens; hits", hits, "of 32", flush=True)
    return {"system_tokens": n_system, "requests": 32, "hits": hits, "cached": cached}


def per_gb(weights: Path, history: int) -> dict[str, Any]:
    """Bytes of the state after ``history`` tokens, the object a cache entry holds (read as
    a session's live ``state_bytes``), and how many such conversations fit in 1 GiB."""
    with ServerProcess(weights) as srv:
        ids = [(i * 7919) % 8000 + 100 for i in range(history)]
        info = httpx.post(srv.url + "/v1/sessions", json={"prompt": ids}, timeout=300).json()
    nbytes = int(info["state_bytes"])
    print(weights.name, "state after", history, "tokens:", nbytes, "bytes", flush=True)
    return {"model": weights.name, "history": history, "entry_bytes": nbytes,
            "conversations_per_gib": 2**30 / nbytes}


def no_reuse(weights: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Random prompts (nothing to reuse), cache on and off, alternated twice so that a slow
    patch of the machine does not fall on one side only."""
    out = []
    for round_ in range(2):
        for on in (True, False):
            with ServerProcess(weights, args=cache_args(on)) as srv:
                rep = loadtest.main(["--url", srv.url, "--concurrency", "16", "--requests",
                                     "96", "--prompt-tokens", "512", "--max-tokens", "64",
                                     "--ignore-eos", "--temperature", "0.8",
                                     "--seed", str(3 + round_)])
                hits = _metric(srv.url, "linserve_prefix_cache_hits_total")
            out.append({"model": weights.name, "cache": on, "round": round_,
                        "output_tokens_per_s": rep["output_tokens_per_s"],
                        "ttft_p50_ms": rep["ttft_ms"]["p50"], "cache_hit_tokens": hits})
            print(out[-1], flush=True)
    return out


def _metric(url: str, name: str) -> float:
    return server_metrics(url).get(name, 0.0)


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {("linear", True): ("tab:blue", "-"), ("linear", False): ("tab:blue", "--"),
              ("softmax", True): ("tab:red", "-"), ("softmax", False): ("tab:red", "--")}
    for (model, on), (color, ls) in styles.items():
        pts = [r for r in rows if r["model"] == model and r["cache"] == on and "ttft_ms" in r]
        ax.plot([r["turn"] for r in pts], [r["ttft_ms"] for r in pts], ls, color=color,
                marker="o", ms=3, label=f"{model}, cache {'on' if on else 'off'}")
    style_axes(ax, "turn (whole history resent)", "time to first token (ms)",
               "stateless 30-turn chat through the openai SDK", logy=False)
    ax.set_xscale("linear")
    save_figure(fig, "multiturn.png")


def take_cost(weights: Path) -> dict[str, Any]:
    """What storing a generation-end entry costs the engine thread: one ``pool.take`` (a
    row copy) and the radix insert, against the batch-64 decode step it runs beside.
    Prompt-end, interval and branch entries are stored without a copy."""
    import torch

    from bench.common import time_ms
    from linserve.model import loader
    from linserve.server.engine.pool import SlotPool
    from linserve.server.prefix_cache import PrefixCache

    torch.set_num_threads(1)
    model = loader.load(weights, "float32")
    pool = SlotPool(model, 64)
    with torch.inference_mode():
        _, row = model.prefill(torch.randint(100, 8000, (1, 1000)))
        for _ in range(64):
            pool.add(row, [], [])
        cache: PrefixCache[Any] = PrefixCache(1 << 30)  # the server default: it evicts
        ids = list(range(100, 1100))
        counter = iter(range(10**9))

        def take_and_insert() -> None:
            state = pool.take(0)
            cache.insert([*ids, next(counter)], state, state.nbytes)

        take = time_ms(take_and_insert, min_seconds=1.0)
        tokens = torch.randint(100, 8000, (64,))
        step = time_ms(lambda: model.step(tokens, pool.view()), min_seconds=1.0)
    print(weights.name, "take+insert", take, "ms; batch-64 step", step, "ms", flush=True)
    return {"model": weights.name, "take_and_insert_ms": take, "step_b64_ms": step,
            "share_of_step": take / step}


PARTS = ("by_turn", "concurrent", "shared_system_prompt", "per_gb", "no_reuse", "take_cost",
         "tools")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights"))
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--parts", nargs="+", choices=PARTS,
                   default=[part for part in PARTS if part != "tools"],
                   help="what to run; the others are kept from the JSON already there")
    p.add_argument("--output", default="multiturn")
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"),
                   help="a Qwen3.5 checkpoint for the tools part")
    args = p.parse_args(argv)
    linear, softmax = args.weights / "linear", args.weights / "softmax"
    path = RESULTS / f"{args.output}.json"
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    runs = {"by_turn": lambda: by_turn(linear, args) + by_turn(softmax, args),
            "concurrent": lambda: concurrent(linear, args),
            "shared_system_prompt": lambda: shared_system_prompt(linear),
            "per_gb": lambda: [per_gb(linear, 4000), per_gb(softmax, 4000)],
            "no_reuse": lambda: no_reuse(linear, args),
            "take_cost": lambda: [take_cost(linear), take_cost(softmax)],
            "tools": lambda: tools(args.checkpoint, args)}
    for part in args.parts:
        result[part] = runs[part]()
        result.setdefault("machine_by_part", {})[part] = machine()
    if "by_turn" in result:
        plot(result["by_turn"])
    print(write_json(args.output, result), RESULTS / "multiturn.png")


if __name__ == "__main__":
    main()
