"""``python -m bench.long_context``: long documents, this server against llama-server on one
GGUF file, both up at once, one client over HTTP, measured alternately.

For each prompt length (``--lengths``, in tokens: 2k, 8k, 32k and 64k by default) each server
gets a fresh document of random words (its own, so that no prompt cache answers) and writes
``--tokens`` tokens after it, streamed: time to first token, decode tokens/s at that depth
(tokens counted from ``usage``, not from chunks: llama-server sends several tokens in one),
and resident memory counted once (PSS of the server's processes) right after. With
``--streams N``: N concurrent conversations, each a ``--stream-context``-token document and a
question, and the memory they hold.

llama-server runs ``-t 2 --parallel 1 -c`` (the longest length plus the output), with
``--llama-args`` added (``-ctk q8_0 -ctv q8_0`` for its int8 cache); this server runs
``--threads 2`` with ``--ours-args``. Writes ``bench/results/long_context.json`` and
``long_context.png`` (``--out`` renames both).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench import llamacpp_compare as lc
from bench import memory
from bench.common import RESULTS, machine, save_figure, write_json

WORDS = ("the of and to in that is was he for it with as his on be at by had are but from "
         "not have this which were they all or she one an there been her so their we when "
         "would what if will no more who can out said about into them up then could some "
         "than time these only two other like its our may made first over new after must").split()


def document(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of random common words (a word is about 1.1 tokens)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens / 1.1)))


def run(url: str, prompt: str, tokens: int) -> dict[str, Any]:
    """One streamed completion: time to first token, decode tokens/s after it, usage."""
    start = time.perf_counter()
    first, usage = None, None
    with httpx.stream("POST", url + "/v1/completions", timeout=3600, json={
            "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and "text" in chunk["choices"][0] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    assert first is not None and usage is not None, "no tokens came back"
    made = int(usage["completion_tokens"])
    return {"ttft_s": round(first - start, 3), "prompt_tokens": int(usage["prompt_tokens"]),
            "decode_tok_s": round((made - 1) / max(end - first, 1e-9), 2),
            "completion_tokens": made}


def streams(url: str, n: int, context: int, seed: int) -> dict[str, Any]:
    """``n`` concurrent conversations over ``context``-token documents."""
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        done = list(pool.map(lambda i: run(url, document(context, seed + i) +
                                           "\n\nQuestion: what is it about?\nAnswer:", 16),
                             range(n)))
    return {"seconds": round(time.perf_counter() - start, 1),
            "prompt_tokens": sum(d["prompt_tokens"] for d in done)}


def held(url: str) -> dict[str, Any]:
    """Where our memory is (``/health``'s parts, bytes) and what the prefix cache holds."""
    health = httpx.get(url + "/health", timeout=30).json()
    return {"memory": health["memory"], "prefix_cache": health.get("prefix_cache")}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    port = lc.free_port()
    ours_cmd = [sys.executable, "-m", "linserve", "serve", str(args.file), "--port", str(port),
                "--threads", "2", "--max-prompt-tokens", str(max(args.lengths) + 1024),
                *shlex.split(args.ours_args)]
    context = max(max(args.lengths), args.stream_context) + args.tokens + 1024
    theirs_cmd, theirs_port = lc.llama_server_cmd(args.file, max(1, args.streams), context)
    theirs_cmd += ["-t", "2", *shlex.split(args.llama_args)]
    out: dict[str, Any] = {"machine": machine(), "file": args.file.name, "lengths": {}}
    urls = {"ours": f"http://127.0.0.1:{port}", "llama_server": f"http://127.0.0.1:{theirs_port}"}
    with lc.running(ours_cmd, port, RESULTS / "long-ours.log") as ours_pid, \
            lc.running(theirs_cmd, theirs_port, RESULTS / "long-llama.log") as theirs_pid:
        pids = {"ours": ours_pid, "llama_server": theirs_pid}
        for url in urls.values():
            run(url, "Hello", 4)  # warm
        for i, length in enumerate(args.lengths):
            row: dict[str, Any] = {}
            for who, url in urls.items():  # alternately, each its own document
                row[who] = run(url, document(length, 1000 * i + len(who)), args.tokens)
                time.sleep(1.0)
                row[who]["pss_bytes"] = memory.pss_bytes(pids[who])
            row["ours"]["health"] = held(urls["ours"])
            out["lengths"][str(length)] = row
            print(length, json.dumps(row))
        if args.streams:
            out["streams"] = {who: {**streams(url, args.streams, args.stream_context, 7),
                                    "pss_bytes": memory.pss_bytes(pids[who])}
                              for who, url in urls.items()}
    return out


def plot(out: dict[str, Any], name: str) -> None:
    import matplotlib.pyplot as plt

    lengths = sorted(int(k) for k in out["lengths"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for who, style in (("ours", "o-"), ("llama_server", "s--")):
        rows = [out["lengths"][str(n)][who] for n in lengths]
        label = who.replace("_", "-")
        axes[0].plot(lengths, [r["ttft_s"] for r in rows], style, label=label)
        axes[1].plot(lengths, [r["decode_tok_s"] for r in rows], style, label=label)
        axes[2].plot(lengths, [r["pss_bytes"] / 2**20 for r in rows], style, label=label)
    for ax, title in zip(axes, ("time to first token, s", "decode tokens/s at that depth",
                                "resident (PSS), MiB"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{out['file']}, 2 threads")
    save_figure(fig, name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path, help="a GGUF file both servers load")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=0)
    p.add_argument("--stream-context", type=int, default=16384)
    p.add_argument("--ours-args", default="")
    p.add_argument("--llama-args", default="")
    p.add_argument("--out", default="long_context")
    args = p.parse_args(argv)
    out = measure(args)
    out["ours_args"], out["llama_args"] = args.ours_args, args.llama_args
    write_json(args.out, out)
    plot(out, args.out)


if __name__ == "__main__":
    main()
