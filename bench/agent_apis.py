"""``python -m bench.agent_apis``: a 10-turn agent conversation on Qwen3.5-0.8B's shapes (its
own template, thinking off), through each way an agent framework talks to a server.

1. **Responses, stored**: ``client.responses`` with ``previous_response_id``; each turn sends
   only the tool's result and the next question. Goal: TTFT of turn 10 ÷ turn 1 ≤ 1.2.
2. **Chat, resent whole**: ``chat.completions`` with the whole history every turn (tools,
   forced calls, tool results), as most agents do. Goal: ≥ 90% of turn 10's prompt served
   from the prefix cache.
3. **Chat without tools, resent whole**: the issue's own measurement (10 turns of chat,
   thinking off), where turn 10 had 0.79 of its prompt cached before the server cached the
   conversation as the template renders it after a reply.
4. **Anthropic messages, resent whole**: the same plain chat through ``/v1/messages``.

Per turn: TTFT (the server's, submission to first token; and the client's first output
event, which for a forced call is its end), the prompt tokens and those
prefilled (the rest came from the stored state or the prefix cache). Writes
``bench/results/agent_apis.json`` and ``agent_apis.png``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from bench.common import machine, save_figure, style_axes, write_json
from bench.multiturn import WEATHER_TOOL, user_turn
from bench.serverproc import ROOT, ServerProcess

TURNS = 10
PARTS = ("responses", "tools", "chat", "anthropic")
SYSTEM = "You are a careful assistant. You answer with tools when you can."
TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat form
OFF = {"enable_thinking": False}


def _row(turn: int, first: float, prompt: int, cached: int) -> dict[str, Any]:
    return {"turn": turn, "first_event_ms": round(first * 1000, 1), "prompt_tokens": prompt,
            "prefilled": prompt - cached, "cached_share": round(cached / prompt, 3)}


def server_ttfts(log: Path) -> list[float]:
    """TTFT of every generation the server logged, in order: from the request's submission
    to its first token reaching the HTTP process (a forced tool call reaches the client
    whole at its end, so the client's first event is no measure of it)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if '"event": "request"' in line:
            record = json.loads(line[line.index("{"):])
            if record["id"].startswith("cmpl-") and record["ttft_ms"] is not None:
                out.append(float(record["ttft_ms"]))
    return out


def responses_stored(client: OpenAI) -> list[dict[str, Any]]:
    """The agent through previous_response_id: only the new items are sent."""
    rows, previous, call = [], None, None
    for turn in range(TURNS):
        items: list[Any] = []
        if call is not None:
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": f"Sunny, {18 + turn} degrees."})
        items.append({"role": "user", "content": user_turn(0, turn)})
        extra: Any = {"previous_response_id": previous} if previous else {
            "instructions": SYSTEM}
        t0, ttft = time.perf_counter(), 0.0
        stream_of: Any = client.responses.stream  # plain-dict items and tools
        with stream_of(model="m", input=items, tools=[TOOL],
                                     tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=60, reasoning={"effort": "none"},
                                     extra_body={"seed": turn}, **extra) as stream:
            for event in stream:
                if not ttft and event.type == "response.output_item.added":
                    ttft = time.perf_counter() - t0
            final = stream.get_final_response()
        assert final.usage is not None
        call = next(o for o in final.output if o.type == "function_call")
        rows.append(_row(turn + 1, ttft, final.usage.input_tokens,
                         final.usage.input_tokens_details.cached_tokens))
        previous = final.id
    return rows


def chat_resent(client: OpenAI, tools: bool) -> list[dict[str, Any]]:
    """Chat completions with the whole history every turn (an agent with forced calls and
    their results, or plain chat)."""
    history: list[Any] = [{"role": "system", "content": SYSTEM}]
    rows = []
    for turn in range(TURNS):
        history.append({"role": "user", "content": user_turn(0, turn)})
        kwargs: dict[str, Any] = {"tools": [WEATHER_TOOL], "tool_choice": "required",
                                  "parallel_tool_calls": False} if tools else {}
        t0, ttft, usage, text = time.perf_counter(), 0.0, None, ""
        calls: dict[int, dict[str, str]] = {}
        stream = client.chat.completions.create(
            model="m", messages=history, max_tokens=60, seed=turn, stream=True,
            stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": OFF},
            **kwargs)
        for chunk in stream:
            if chunk.choices and not ttft:
                ttft = time.perf_counter() - t0
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(d.index, {"id": d.id or "", "name": "",
                                                   "arguments": ""})
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert usage is not None and usage.prompt_tokens_details is not None
        rows.append(_row(turn + 1, ttft, usage.prompt_tokens,
                         usage.prompt_tokens_details.cached_tokens or 0))
        if tools:
            call = calls[0]
            history += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": call["id"],
                 "content": f"Sunny, {18 + turn} degrees."}]
        else:
            history.append({"role": "assistant", "content": text})
    return rows


def messages_resent(url: str) -> list[dict[str, Any]]:
    """Plain chat through Anthropic's Messages API, the whole history every turn."""
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=900)
    history: list[Any] = []
    rows = []
    for turn in range(TURNS):
        history.append({"role": "user", "content": user_turn(0, turn)})
        t0, ttft = time.perf_counter(), 0.0
        with client.messages.stream(model="m", system=SYSTEM, messages=history,
                                    max_tokens=60, extra_body={"seed": turn}) as stream:
            for event in stream:
                if not ttft and event.type == "content_block_start":
                    ttft = time.perf_counter() - t0
            final = stream.get_final_message()
        u = final.usage
        prompt = u.input_tokens + (u.cache_read_input_tokens or 0)
        rows.append(_row(turn + 1, ttft, prompt, u.cache_read_input_tokens or 0))
        history.append({"role": "assistant",
                        "content": "".join(b.text for b in final.content if b.type == "text")
                        or "."})
    return rows


def plot(result: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in result["runs"].items():
        turns = [r["turn"] for r in rows]
        left.plot(turns, [r["ttft_ms"] for r in rows], marker="o", label=name)
        right.plot(turns, [r["cached_share"] for r in rows], marker="o", label=name)
    style_axes(left, "turn", "TTFT (ms)", "Time to first token by turn", logy=False)
    style_axes(right, "turn", "share of the prompt not prefilled",
               "Prompt served from state or cache", logy=False)
    for ax in (left, right):
        ax.set_xscale("linear")  # turns, not sizes
        ax.set_xticks(range(1, TURNS + 1))
    left.legend(fontsize=8)
    left.set_ylim(bottom=0)
    save_figure(fig, "agent_apis.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"),
                   help="a Qwen3.5 folder (python -m bench.hf --make builds the 0.8B shapes)")
    p.add_argument("--server-args", type=shlex.split, default=[],
                   help="more server flags")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {}
    with ServerProcess(ROOT / "weights" / "linear", ready_timeout=900,
                       args=["--model", str(args.checkpoint), *args.server_args]) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=900)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2)  # warm-up
        parts = {"responses": ("responses, previous_response_id",
                               lambda: responses_stored(client)),
                 "tools": ("chat with tools, resent whole",
                           lambda: chat_resent(client, tools=True)),
                 "chat": ("chat, resent whole", lambda: chat_resent(client, tools=False)),
                 "anthropic": ("anthropic messages, resent whole",
                               lambda: messages_resent(srv.url))}
        for part in args.parts:
            name, run = parts[part]
            runs[name] = run()
        ttfts = server_ttfts(srv.log_path)[1:]  # after the warm-up, in the runs' order
    for rows in runs.values():
        for row in rows:
            row["ttft_ms"] = ttfts.pop(0)
    summary = {name: {"ttft_turn10_over_turn1": round(rows[-1]["ttft_ms"] / rows[0]["ttft_ms"],
                                                      2),
                      "turn10_cached_share": rows[-1]["cached_share"],
                      "all_turns_cached_share": round(
                          sum(r["prompt_tokens"] - r["prefilled"] for r in rows)
                          / sum(r["prompt_tokens"] for r in rows), 3)}
               for name, rows in runs.items()}
    result = {"machine": machine(), "checkpoint": str(args.checkpoint),
              "server_args": args.server_args, "runs": runs,
              "summary": summary}
    write_json("agent_apis" if len(args.parts) == len(PARTS) else
               "agent_apis-" + "-".join(args.parts), result)
    if len(args.parts) == len(PARTS):
        plot(result)
    for name, row in summary.items():
        print(f"{name:36s} {row}")


if __name__ == "__main__":
    main()
