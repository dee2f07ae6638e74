"""``python -m bench.spec_llamacpp``: speculative decoding with the checkpoint's own MTP
layer, this server against ``llama-server --spec-type draft-mtp`` (issue 61; never run by CI;
``bash bench/llamacpp.sh build`` first).

The trained checkpoint ``weights/qwen35-mtp`` (Qwen3.5's architecture, one MTP layer trained
to predict the token after next) is copied to ``--root`` and converted by llama.cpp's own
converter with its MTP layer (bf16, the project's tokenizer named GPT-2's pre-tokenizer).
Two pairs of servers are measured, each pair up at once and driven alternately by one client
over HTTP: plain decoding (``linserve serve`` / ``llama-server``), then speculation with
``--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'`` against
``--spec-type draft-mtp --spec-draft-n-max K``. Each request: a Shakespeare prompt, greedy,
``--tokens`` tokens with the end of text ignored; tokens/s = completion tokens over the
request's wall time, the median of ``--rounds``. Writes ``bench/results/spec_llamacpp.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import llamacpp_compare as lc
from bench.common import RESULTS, machine, print_table, write_json
from bench.serverproc import free_port

PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
           "KING HENRY:\nOnce more unto the breach, dear friends, once more;\n",
           "HAMLET:\nTo be, or not to be, that is the question:\n",
           "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?\n"]


# --weights: this server's flags for them (llama-server gets the converter's file, or
# llama-quantize's Q8_0 of its bf16 one)
OURS = {"bf16": ["--dtype", "bfloat16"], "f32": ["--dtype", "float32"],
        "q8_0": ["--quantization", "int8"]}


def ours_cmd(checkpoint: Path, k: int, weights: str = "bf16") -> tuple[list[str], int]:
    port = free_port()
    cmd = [sys.executable, "-m", "linserve", "serve", "--model", str(checkpoint), "--port",
           str(port), "--threads", "2", *OURS[weights]]
    if k:
        cmd += ["--speculative-config", json.dumps({"method": "mtp",
                                                    "num_speculative_tokens": k})]
    return cmd, port


def theirs_cmd(gguf: Path, k: int) -> tuple[list[str], int]:
    cmd, port = lc.llama_server_cmd(gguf, 1, 2048)
    cmd += ["-t", "2"]
    if k:
        cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k)]
    return cmd, port


def one(port: int, prompt: str, tokens: int) -> dict[str, Any]:
    """One greedy completion: tokens/s over its wall time, and llama-server's draft counts
    where it reports them."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True}
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    seconds = time.perf_counter() - start
    out = r.json()
    n = int(out["usage"]["completion_tokens"])
    timings = out.get("timings") or {}
    return {"tokens": n, "tok_s": n / seconds, "draft_n": timings.get("draft_n"),
            "draft_accepted": timings.get("draft_n_accepted")}


def pair(checkpoint: Path, gguf: Path, k: int, rounds: int, tokens: int,
         weights: str = "bf16") -> dict[str, Any]:
    """Both servers up, requests alternately; the median tokens/s of each."""
    ours, o_port = ours_cmd(checkpoint, k, weights)
    theirs, t_port = theirs_cmd(gguf, k)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "llama_server": []}
    with lc.running(ours, o_port, RESULTS / f"spec-llamacpp-ours-k{k}.log"), \
            lc.running(theirs, t_port, RESULTS / f"spec-llamacpp-theirs-k{k}.log"):
        for port in (o_port, t_port):  # warm up
            one(port, PROMPTS[0], 16)
        for i in range(rounds):
            prompt = PROMPTS[i % len(PROMPTS)]
            runs["ours"].append(one(o_port, prompt, tokens))
            runs["llama_server"].append(one(t_port, prompt, tokens))
        metrics = httpx.get(f"http://127.0.0.1:{o_port}/metrics", timeout=10).text
    out: dict[str, Any] = {"k": k}
    for who, rows in runs.items():
        rates = sorted(r["tok_s"] for r in rows)
        out[who] = {"tok_s": rates[len(rates) // 2], "runs": rows}
    drafted = [r for r in runs["llama_server"] if r["draft_n"]]
    if drafted:
        out["llama_server"]["acceptance"] = (sum(r["draft_accepted"] for r in drafted)
                                             / sum(r["draft_n"] for r in drafted))
    out["ours"]["acceptance"] = _acceptance(metrics)
    return out


def _acceptance(metrics: str) -> float | None:
    """Accepted over drafted tokens from this server's Prometheus counters."""
    values: dict[str, float] = {}
    for line in metrics.splitlines():
        for name in ("linserve_spec_decode_draft_tokens_total",
                     "linserve_spec_decode_accepted_tokens_total"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    drafted = values.get("linserve_spec_decode_draft_tokens_total")
    return values.get("linserve_spec_decode_accepted_tokens_total", 0.0) / drafted \
        if drafted else None


def _gguf(copy: Path, weights: str) -> Path:
    """llama-server's file of ``weights`` for the checkpoint at ``copy`` (made once)."""
    script = str(Path(__file__).with_name("llamacpp.sh"))
    out = copy / f"llamacpp-{weights}.gguf"
    if out.exists():
        return out
    if weights == "q8_0":
        subprocess.run(["bash", script, "quantize", str(_gguf(copy, "bf16")), str(out),
                        "Q8_0"], check=True)
        return out
    subprocess.run(["bash", script, "convert", str(copy), str(out), weights], check=True,
                   env={**os.environ, "LINSERVE_GGUF_PRE": "gpt-2"})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("weights/qwen35-mtp"))
    p.add_argument("--root", type=Path, default=Path("/tmp"))
    p.add_argument("--k", type=int, default=3, help="draft tokens a step")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--weights", choices=sorted(OURS), default="bf16",
                   help="both servers' weights: ours --dtype bfloat16 / float32 or "
                        "--quantization int8, theirs the converter's bf16 / f32 file or "
                        "llama-quantize's Q8_0")
    args = p.parse_args(argv)
    copy = args.root / args.checkpoint.name
    if not copy.exists():
        shutil.copytree(args.checkpoint, copy)
    gguf = _gguf(copy, args.weights)
    plain = pair(copy, gguf, 0, args.rounds, args.tokens, args.weights)
    spec = pair(copy, gguf, args.k, args.rounds, args.tokens, args.weights)
    rows = [{"server": who, "plain tok/s": round(plain[who]["tok_s"], 1),
             f"mtp k={args.k} tok/s": round(spec[who]["tok_s"], 1),
             "speedup": round(spec[who]["tok_s"] / plain[who]["tok_s"], 2),
             "acceptance": spec[who].get("acceptance")}
            for who in ("ours", "llama_server")]
    print_table(rows, list(rows[0]))
    ratio = spec["ours"]["tok_s"] / spec["llama_server"]["tok_s"]
    print(f"ours ÷ llama-server with speculation: {ratio:.2f}")
    command = "python -m bench.spec_llamacpp " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])
    name = "spec_llamacpp" if copy.name == "qwen35-mtp" and args.weights == "bf16" \
        else f"spec_llamacpp-{copy.name}-{args.weights}"
    write_json(name, {"command": command, "machine": machine(), "plain": plain,
                                 "speculative": spec, "rows": rows, "ratio": ratio})


if __name__ == "__main__":
    main()
