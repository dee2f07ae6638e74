"""``python -m bench.agent_loop``: a next turn sent the moment the reply ends, against one sent
after a pause, on Qwen3.5-0.8B's shapes with their template (bf16, thinking off).

Six turns of ~220 words each, replies of 24 tokens, streamed; per turn the client's time
to first token; per conversation the prompt tokens the model ran (requests and post-reply
prefills, from ``linserve_prompt_tokens_computed_total``) against its last prompt.
Conversations alternate between the two kinds (each with its own text, so no conversation
finds another's states): the VM's bandwidth drifts within minutes. Goals: TTFT at once
≤ 1.15× after a pause; tokens run within 10% of the conversation's. Writes
``bench/results/agent_loop.json`` and ``agent_loop.png``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from bench.common import machine, save_figure, write_json
from bench.serverproc import ROOT, ServerProcess

WORDS = ("over hill over dale thorough bush thorough brier over park over pale thorough "
         "flood thorough fire I do wander everywhere swifter than the moon's sphere").split()
MODES = {"at once": 0.0, "after a pause": 5.0}


def user_text(conv: int, turn: int, words: int = 220) -> str:
    """~``words`` words, different for every conversation and turn."""
    return " ".join(WORDS[(conv * 7 + turn * 3 + i) % len(WORDS)] for i in range(words))


def computed(url: str) -> float:
    """Prompt tokens the model ran so far, every kind of request."""
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(
        r'linserve_prompt_tokens_computed_total\{kind="\w+"\} ([\d.e+]+)', text))


def conversation(client: OpenAI, url: str, conv: int, pause: float, turns: int
                 ) -> dict[str, Any]:
    """One conversation: per turn its TTFT and prompt tokens; and the prompt tokens the
    model ran over the whole conversation (requests and post-reply prefills, read as the
    last reply ends) against its last prompt, which holds every message once as rendered:
    1.0 is every token run once."""
    msgs: list[Any] = []
    rows: list[dict[str, Any]] = []
    start = computed(url)
    for turn in range(turns):
        msgs.append({"role": "user", "content": user_text(conv, turn)})
        t0 = time.perf_counter()
        ttft, text, usage = None, "", None
        for chunk in client.chat.completions.create(
                model="q", messages=msgs, max_tokens=24, temperature=0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"chat_template_kwargs": {"enable_thinking": False},
                            "ignore_eos": True}):
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
            text += delta or ""
            usage = chunk.usage or usage
        assert usage is not None and ttft is not None
        msgs.append({"role": "assistant", "content": text})
        rows.append({"turn": turn + 1, "ttft_s": round(ttft, 3),
                     "prompt_tokens": usage.prompt_tokens,
                     "cached_tokens": usage.prompt_tokens_details.cached_tokens
                     if usage.prompt_tokens_details else 0})
        if turn < turns - 1:
            time.sleep(pause)
    ran = computed(url) - start
    return {"turns": rows, "computed": ran,
            "computed_over_prompt": round(ran / rows[-1]["prompt_tokens"], 3)}


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median TTFT of turns 2+ per mode, their ratio, and tokens run per prompt token."""
    out: dict[str, Any] = {}
    for mode, convs in runs.items():
        later = [r["ttft_s"] for conv in convs for r in conv["turns"][1:]]
        out[mode] = {"median_ttft_s": round(statistics.median(later), 3),
                     "computed_over_prompt": [c["computed_over_prompt"] for c in convs]}
    out["ttft_ratio"] = round(out["at once"]["median_ttft_s"]
                              / out["after a pause"]["median_ttft_s"], 3)
    return out


def plot(runs: dict[str, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, convs in runs.items():
        turns = [r["turn"] for r in convs[0]["turns"]]
        ax.plot(turns, [statistics.median(c["turns"][i]["ttft_s"] for c in convs)
                        for i in range(len(turns))], "o-", label=mode)
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Next turn sent at once vs after a pause (Qwen3.5-0.8B shapes, bf16)")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, "agent_loop.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"),
                   help="a Qwen3.5 folder (python -m bench.hf --make builds the 0.8B shapes)")
    p.add_argument("--conversations", type=int, default=2, help="of each kind")
    p.add_argument("--turns", type=int, default=6)
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with ServerProcess(ROOT / "weights" / "linear", ready_timeout=600, args=[
            "--model", str(args.checkpoint), "--dtype", "bfloat16", "--threads", "2",
            "--served-model-name", "q"]) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        for conv in range(args.conversations):
            for k, (mode, pause) in enumerate(MODES.items()):
                runs[mode].append(conversation(client, srv.url, 2 * conv + k, pause,
                                               args.turns))
                time.sleep(5)  # the last post-reply prefill ends before the next conversation
    result = summary(runs)
    print(result)
    write_json("agent_loop", {"command": "python -m bench.agent_loop", "machine": machine(),
                              "summary": result, "runs": runs})
    plot(runs)


if __name__ == "__main__":
    main()
