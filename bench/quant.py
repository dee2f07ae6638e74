"""``python -m bench.quant``: int8 and int4 weights (``--quantization``) on the published
Qwen3.5-0.8B shapes, against bf16 and against llama.cpp's Q8_0 / Q4_0 of the same weights.

The checkpoint is ``bench.hf``'s (random weights in the published shapes, bf16 on disk; made
with ``python -m bench.hf --make``). In one run, for each weight type:

- batch-1 decode tokens/s at 1 and 2 threads (1,024 tokens of context) and batch-16 decode;
- the bytes a batch-1 step moves (every GEMM weight once as stored, the norms, the
  recurrent state read and written, the KV cache's positions read: ``step_bytes``) and the
  fraction of the read roofline it reaches (``bench.roofline``, one thread);
- with ``--llamacpp`` (after ``bash bench/llamacpp.sh build``): ``llama-bench`` on the
  BF16 / Q8_0 / Q4_0 GGUFs (Q4_0 made with ``llama-quantize``, which keeps the tied
  embedding / output matrix in Q6_K), and ``--streams`` concurrent streaming clients against
  this server and ``llama-server --parallel N`` for each type: aggregate output tokens/s
  and the resident memory of each server after the run (the engine process included).

Writes ``bench/results/quant.json`` and ``quant.png`` (tokens/s against bytes a token).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from bench import llamacpp_compare as lc
from bench.common import (
    RESULTS,
    machine,
    print_table,
    read_json,
    rss_bytes,
    save_figure,
    write_json,
)
from bench.hf import decode_row, step_bytes
from bench.roofline import read_bandwidth_gbs
from linserve.model import loader
from linserve.model.served import ServedModule

TYPES = {"bf16": "none", "int8": "int8", "int4": "int4"}  # ours -> --quantization
GGUF = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}   # the llama.cpp type beside it


def ours(checkpoint: Path, kind: str, threads: list[int], context: int, bw: float
         ) -> dict[str, Any]:
    """In-process figures of one weight type."""
    model = loader.load(checkpoint, "bfloat16", quantization=TYPES[kind])
    assert isinstance(model, ServedModule)
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        rows += [decode_row(model, b, context) for b in (1, 16)]
    read = step_bytes(model, context)
    one = next(r for r in rows if r["batch"] == 1 and r["threads"] == 1)
    return {"decode": rows, "weight_bytes": model.info.weight_bytes, "bytes_per_step": read,
            "roofline_ms_1_thread": round(read / bw / 1e6, 2),
            "of_roofline_1_thread": round(read / bw / 1e6 / one["step_ms"], 3)}


def servers(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """``--streams`` concurrent streams against this server and llama-server, one type."""
    prompt, gen = 128, 128
    keep = ("output_tokens_per_s", "ttft_ms", "tpot_ms", "errors", "wall_seconds",
            "engine_seconds")
    out: dict[str, Any] = {}
    port = lc.free_port()
    cmd = [sys.executable, "-m", "linserve", "serve", "--model", str(args.checkpoint), "--dtype",
           "bfloat16", "--quantization", TYPES[kind], "--port", str(port), "--max-running",
           str(args.streams), "--threads", str(args.server_threads)]
    report = lc.serve_and_load(cmd, port, args.streams, 3 * args.streams, prompt, gen,
                               RESULTS / f"quant-server-{kind}.log", measure=rss_bytes)
    out["ours"] = {k: report.get(k) for k in (*keep, "rss_bytes")}
    cmd, port = lc.llama_server_cmd(lc.gguf(args.checkpoint, GGUF[kind]), args.streams,
                                    prompt + gen)
    report = lc.serve_and_load(cmd, port, args.streams, 3 * args.streams, prompt, gen,
                               RESULTS / f"quant-llama-server-{kind}.log", measure=rss_bytes)
    out["llama_server"] = {k: report.get(k) for k in (*keep, "rss_bytes")}
    return out


def idle_memory(args: argparse.Namespace, kind: str) -> dict[str, int]:
    """Resident bytes of each server once started and healthy, before any request: the
    weights as served, the runtime (both of this server's processes) and the state of
    ``--streams`` rows (this server's slot pool; llama-server's slots of 256 tokens)."""
    out: dict[str, int] = {}
    port = lc.free_port()
    ours_cmd = [sys.executable, "-m", "linserve", "serve", "--model", str(args.checkpoint),
                "--dtype", "bfloat16", "--quantization", TYPES[kind], "--port", str(port),
                "--max-running", str(args.streams)]
    theirs_cmd, theirs_port = lc.llama_server_cmd(lc.gguf(args.checkpoint, GGUF[kind]),
                                                  args.streams, 256)
    for who, cmd, at in (("ours", ours_cmd, port), ("llama_server", theirs_cmd, theirs_port)):
        with lc.running(cmd, at, RESULTS / f"quant-idle-{who}-{kind}.log") as pid:
            out[who] = rss_bytes(pid)
    return out


def plot(result: dict[str, Any]) -> None:
    """Batch-1 decode tokens/s (1 and 2 threads) against bytes read a token."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for threads, marker in ((1, "o"), (2, "s")):
        for who, color in (("ours", "C0"), ("llama.cpp", "C1")):
            xs, ys, names = [], [], []
            for kind, row in result["types"].items():
                if who == "ours":
                    tps = next(r["tokens_per_s"] for r in row["decode"]
                               if r["batch"] == 1 and r["threads"] == threads)
                    xs.append(row["bytes_per_step"] / 1e9)
                else:
                    bench = row.get("llama_bench")
                    if not bench:
                        continue
                    tps = next(r["tokens_per_s"] for r in bench["rows"]
                               if r["test"].startswith("tg") and r["threads"] == threads)
                    xs.append(bench["gguf_bytes"] / 1e9)
                ys.append(tps)
                names.append(kind if who == "ours" else GGUF[kind].upper())
            ax.plot(xs, ys, marker=marker, color=color, linestyle="-" if threads == 1 else "--",
                    label=f"{'this server' if who == 'ours' else 'llama.cpp'}, {threads} thread"
                          f"{'s' if threads > 1 else ''}")
            for x, y, n in zip(xs, ys, names, strict=True):
                ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    grid = [0.4 + 0.02 * i for i in range(61)]
    ax.plot(grid, [result["read_gbs_1_thread"] / g for g in grid], ":", color="gray",
            label="read roofline, 1 thread")
    ax.set_ylim(top=70)
    ax.set_xlabel("bytes read a token (GB)")
    ax.set_ylabel("decode tokens/s, batch 1")
    ax.set_title("Qwen3.5-0.8B shapes: weight types")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, "quant.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"))
    p.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--llamacpp", action="store_true", help="compare with llama.cpp")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--server-threads", type=int, default=2)
    p.add_argument("--keep-servers", action="store_true",
                   help="with --llamacpp: skip the 16-stream runs and keep those of the last "
                        "quant.json (the in-process and llama-bench figures are one run)")
    p.add_argument("--memory-only", action="store_true",
                   help="only each server's idle resident memory, added to quant.json")
    args = p.parse_args(argv)
    if args.memory_only:
        saved = read_json("quant")
        for kind in args.types:
            saved["result"]["types"][kind]["idle_rss_bytes"] = idle_memory(args, kind)
            print(kind, saved["result"]["types"][kind]["idle_rss_bytes"], flush=True)
        write_json("quant", saved)
        return
    bw = read_bandwidth_gbs()
    result: dict[str, Any] = {"read_gbs_1_thread": round(bw, 2), "types": {}}
    for kind in args.types:
        row = ours(args.checkpoint, kind, args.threads, args.context, bw)
        if args.llamacpp:
            path = lc.gguf(args.checkpoint, GGUF[kind])
            row["llama_bench"] = {"gguf": path.name, "gguf_bytes": path.stat().st_size,
                                  "rows": lc.llama_bench(path, args.threads, 512, 64)}
        result["types"][kind] = row
        print(kind, row, flush=True)
    kept = read_json("quant")["result"]["types"] if args.keep_servers else {}
    for kind in args.types if args.llamacpp else []:
        row = result["types"][kind]
        row["servers"] = kept[kind]["servers"] if kind in kept else servers(args, kind)
        print(kind, row["servers"], flush=True)
    print_table([{"type": k, **r} for k, v in result["types"].items() for r in v["decode"]],
                ["type", "threads", "batch", "step_ms", "tokens_per_s"])
    write_json("quant", {"machine": machine(), "args": {**vars(args),
                                                        "checkpoint": str(args.checkpoint)},
                         "result": result})
    plot(result)


if __name__ == "__main__":
    main()
