"""``python -m bench.memory``: resident memory against llama-server on the same weights, as a
new user would see it, with this server's own account of where its bytes go.

For each weight type (bf16, int8 against Q8_0, int4 against Q4_0) on ``bench.hf``'s
checkpoint of the published Qwen3.5-0.8B shapes, both servers are started at once:

- this server as a user starts it: ``linserve serve --model DIR --threads 2`` (its
  default ``--max-running``), with ``--quantization``;
- ``llama-server -t 2 --parallel 16 -c 32768`` on the GGUF of the same weights
  (``bash bench/llamacpp.sh build`` first; GGUFs are made once by ``bench.llamacpp_compare``).

Then, alternating between the two with the same client (``bench.loadtest`` over HTTP):
one stream alone (batch-1 decode), then ``--streams`` concurrent streams of ``--tokens``
tokens after prompts of 128. Recorded for each server: the peak resident memory while it
loaded (``VmHWM``, each process; summed over this server's two processes, whose peaks
come one after the other), its resident memory idle and after the streams, and output
tokens/s; for this server also ``/health``'s memory report after the streams. After the
streams each tree's PSS is recorded too: this server is two processes, and summed RSS
counts the libraries both map (torch's) twice.

Writes ``bench/results/memory.json`` and ``memory.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import llamacpp_compare as lc
from bench import loadtest
from bench.common import RESULTS, child_pids, machine, read_json, save_figure, write_json
from bench.quant import GGUF, TYPES, rss_bytes


def _tree_sum(pid: int, file: str, field: str) -> int:
    """``field`` (kB) of ``/proc/P/file`` summed over ``pid`` and its children, in bytes."""
    total = 0
    for p in [pid, *child_pids(pid)]:
        with contextlib.suppress(OSError, StopIteration):
            text = Path(f"/proc/{p}/{file}").read_text()
            total += int(next(ln.split()[1] for ln in text.splitlines()
                              if ln.startswith(field))) * 1024
    return total


def peak_bytes(pid: int) -> int:
    """The most each process of ``pid``'s tree held at once (``VmHWM``), summed."""
    return _tree_sum(pid, "status", "VmHWM:")


def pss_bytes(pid: int) -> int:
    """Proportional set size of ``pid``'s tree: a page shared by n processes (a library both
    of this server's processes map, as torch's) counts 1/n in each, so the sum counts it
    once, where summed RSS counts it in every process."""
    return _tree_sum(pid, "smaps_rollup", "Pss:")


def _load(url: str, streams: int, requests: int, tokens: int, prompt: int = 128,
          seed: int = 0) -> dict[str, Any]:
    report = loadtest.main(["--url", url, "--concurrency", str(streams), "--requests",
                            str(requests), "--prompt-tokens", str(prompt), "--max-tokens",
                            str(tokens), "--ignore-eos", "--temperature", "0.8", "--seed",
                            str(seed)])
    return {k: report.get(k) for k in ("output_tokens_per_s", "tpot_ms", "ttft_ms", "errors",
                                       "mean_prompt_tokens")}


def _prefill(url: str, prompt: int, requests: int = 2) -> dict[str, Any]:
    """Prompt tokens/s of ``requests`` requests of about ``prompt`` tokens and one output
    token each: the prompt over the median time to the first token, of prompts neither
    server has seen (a seed of their own, so no prefix cache serves them)."""
    run = _load(url, 1, requests, 1, prompt=prompt, seed=7)
    run["prompt_tokens_per_s"] = run["mean_prompt_tokens"] / (run["ttft_ms"]["p50"] / 1e3)
    return run


def one_kind(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Both servers up at once for one weight type; figures as the module docstring says."""
    port = lc.free_port()
    ours_cmd = [sys.executable, "-m", "linserve", "serve", "--model", str(args.checkpoint),
                "--dtype", "bfloat16", "--quantization", TYPES[kind], "--port", str(port),
                "--threads", "2", *getattr(args, "ours_args", [])]
    theirs_cmd, theirs_port = lc.llama_server_cmd(lc.gguf(args.checkpoint, GGUF[kind]), 16,
                                                  2048)
    theirs_cmd += ["-t", "2"]
    if getattr(args, "prefill", 0):
        theirs_cmd += ["--kv-unified"]  # one pool of 16 x 2048: a slot may hold a long prompt
    out: dict[str, Any] = {"ours": {}, "llama_server": {}}
    with lc.running(ours_cmd, port, RESULTS / f"memory-ours-{kind}.log") as ours_pid, \
            lc.running(theirs_cmd, theirs_port, RESULTS / f"memory-llama-{kind}.log") as theirs:
        servers = {"ours": (ours_pid, f"http://127.0.0.1:{port}"),
                   "llama_server": (theirs, f"http://127.0.0.1:{theirs_port}")}
        for who, (pid, _) in servers.items():
            out[who]["load_peak_bytes"] = peak_bytes(pid)
            out[who]["idle_bytes"] = rss_bytes(pid)
        for who, (_, url) in servers.items():  # alternately: batch 1, then the streams
            out[who]["batch1"] = _load(url, 1, 2, args.tokens)
        for who, (_, url) in servers.items():
            if getattr(args, "prefill", 0):
                out[who]["prefill"] = _prefill(url, args.prefill,
                                               getattr(args, "prefill_requests", 2))
        for who, (pid, url) in servers.items():
            out[who]["streams"] = _load(url, args.streams, args.streams, args.tokens)
            time.sleep(2.0)
            out[who]["after_streams_bytes"] = rss_bytes(pid)
            out[who]["after_streams_pss_bytes"] = pss_bytes(pid)
        out["ours"]["report"] = httpx.get(servers["ours"][1] + "/health",
                                          timeout=30).json()["memory"]
    ours, theirs_ = out["ours"], out["llama_server"]
    out["ratios"] = {
        "after_streams": ours["after_streams_bytes"] / theirs_["after_streams_bytes"],
        "after_streams_pss": ours["after_streams_pss_bytes"]
        / theirs_["after_streams_pss_bytes"],
        "idle": ours["idle_bytes"] / theirs_["idle_bytes"],
        "load_peak_over_final": ours["load_peak_bytes"] / ours["after_streams_bytes"],
        "batch1_tok_s": ours["batch1"]["output_tokens_per_s"]
        / theirs_["batch1"]["output_tokens_per_s"],
        "streams_tok_s": ours["streams"]["output_tokens_per_s"]
        / theirs_["streams"]["output_tokens_per_s"]}
    if "prefill" in ours:
        out["ratios"]["prefill_tok_s"] = (ours["prefill"]["prompt_tokens_per_s"]
                                          / theirs_["prefill"]["prompt_tokens_per_s"])
    return out


def plot(result: dict[str, Any]) -> None:
    """Stacked bars of this server's parts beside llama-server's total, per weight type."""
    import matplotlib.pyplot as plt

    kinds = list(result["types"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    parts = list(result["types"][kinds[0]]["ours"]["report"]["parts"])
    for i, kind in enumerate(kinds):
        rep = result["types"][kind]["ours"]["report"]["parts"]
        bottom = 0.0
        for j, part in enumerate(parts):
            gb = rep[part] / 1e9
            ax.bar(2 * i, gb, bottom=bottom, color=f"C{j}", label=part if i == 0 else None)
            bottom += gb
        ax.bar(2 * i + 0.8, result["types"][kind]["llama_server"]["after_streams_bytes"] / 1e9,
               color="black", label="llama-server (total)" if i == 0 else None)
    ax.set_xticks([2 * i + 0.4 for i in range(len(kinds))], kinds)
    ax.set_ylabel("resident after 16 streams (GB)")
    ax.set_title("Resident memory: this server's parts against llama-server")
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    ax.set_ylim(0, 1.3 * ax.get_ylim()[1])
    save_figure(fig, "memory")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"))
    p.add_argument("--kinds", nargs="+", default=list(TYPES), choices=list(TYPES))
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--ours-args", nargs="*", default=[],
                   help="more arguments for this server, each as --ours-args=--flag=value")
    p.add_argument("--label", default="",
                   help="record the run under KIND-LABEL (a variant beside the default run)")
    p.add_argument("--plot-only", action="store_true", help="redraw memory.png from memory.json")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(read_json("memory")["result"])
        return
    command = "python -m bench.memory " + " ".join(argv or sys.argv[1:])
    result: dict[str, Any] = {"machine": machine(), "types": {}}
    with contextlib.suppress(FileNotFoundError, KeyError):  # other weight types' runs stay
        result["types"] = read_json("memory")["result"]["types"]
    for kind in args.kinds:
        run = one_kind(args, kind)
        run["command"], run["machine"] = command, machine()
        result["types"][f"{kind}-{args.label}" if args.label else kind] = run
        print(kind, run["ratios"], flush=True)
        write_json("memory", {"command": command, "result": result})
    plot(result)


if __name__ == "__main__":
    main()
