"""``python -m bench.hf``: a Qwen3.5 checkpoint with the published 0.8B shapes, served by
this project's model, against the memory-bandwidth roofline, transformers and llama.cpp.

The checkpoint is random weights in the published shapes (24 layers, hidden 1,024, 8 query
and 2 KV heads of 256, Gated DeltaNet with 16 key and 16 value heads of 128, conv 4, full
attention every 4th layer, vocabulary 248,320, tied embeddings), with a real Qwen-family
tokenizer (llama.cpp's ``ggml-vocab-qwen35.gguf``, 151,936 ids) and Qwen3.5's template.
``intermediate_size`` is not in the issue's list: 3,584 is assumed. ``--make`` builds and
saves it with transformers (bf16 on disk). Measured in one run, at each of ``--threads``:

- decode tokens/s at batch 1, 8 and 32 with ``--contexts`` tokens already in every row (the
  KV part filled to that length, the GDN state really prefilled); batch 32 is skipped past
  4k of context (32 rows of 16k KV are 13 GB);
- batch-1 decode against the roofline: bytes a step must move (``step_bytes``: every weight
  once, the recurrent state read and written, the KV positions read) / step time, over the
  read bandwidth of one thread (``bench.roofline``);
- prefill tokens/s for a ``--prompt``-token prompt (= its time to first token);
- bytes per session at 1k, 16k and 128k tokens;
- transformers' ``generate`` at batch 1 (the floor), unless ``--no-transformers``;
- with ``--llamacpp`` (after ``bash bench/llamacpp.sh build``): llama-bench batch-1 decode
  and prefill on GGUFs of the same weights (bf16 — this CPU's native type —, f16, q8_0 and
  f32, converted by llama.cpp's own script), and the aggregate output tokens/s of 16
  concurrent streams, ``llama-server --parallel 16`` against this server, both driven by
  ``bench.loadtest``.

Writes ``bench/results/hf.json`` and ``hf.png``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import llamacpp_compare as lc
from bench.common import RESULTS, machine, print_table, save_figure, time_ms, write_json
from bench.roofline import read_bandwidth_gbs
from linserve.model import loader
from linserve.model.served import ServedModule
from linserve.model.state import KVEntry, State

PUBLISHED_0_8B = dict(vocab_size=248_320, hidden_size=1024, intermediate_size=3584,
                      num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                      linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, max_position_embeddings=262_144,
                      tie_word_embeddings=True)


# A 4B-class shape (about 4.2B parameters, random weights): Qwen3.5's layer pattern at
# hidden 2,560, as a step of several GB reads its weights.
SHAPE_4B = {**PUBLISHED_0_8B, "hidden_size": 2560, "intermediate_size": 9216,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
            "linear_num_value_heads": 32}


def make(path: Path, shape: dict[str, Any] | None = None) -> None:
    """Save a random-weight checkpoint of ``shape`` (default: the published 0.8B shapes) in
    bf16 with a tokenizer."""
    from bench.llamacpp_assets import write_qwen_tokenizer_files

    transformers: Any = importlib.import_module("transformers")  # a dev dependency
    cfg = transformers.Qwen3_5TextConfig(**(shape or PUBLISHED_0_8B))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.tie_weights()  # to_empty() untied the head from the embedding
    model.save_pretrained(path)
    write_qwen_tokenizer_files(path)  # a real Qwen-family tokenizer and Qwen3.5's template


def state_at(model: ServedModule, batch: int, context: int) -> State:
    """``batch`` rows as after ``context`` tokens: the GDN part prefilled (64 real tokens,
    its cost does not depend on the length), the KV part filled with noise to ``context``."""
    _, row = model.prefill(torch.randint(0, 8000, (1, 64)))
    state = State.cat([row.copy() for _ in range(batch)])
    state.reserve(context + 8)
    for e in state.entries():
        if isinstance(e, KVEntry):
            e.k.normal_()
            e.v.normal_()
    state.lengths.fill_(context)
    return state


def decode_row(model: ServedModule, batch: int, context: int) -> dict[str, Any]:
    state = state_at(model, batch, context)
    tokens = torch.randint(0, 8000, (batch,))

    def step() -> None:
        model.step(tokens, state)
        state.lengths -= 1  # the same position every call

    ms = time_ms(step, min_iters=3, min_seconds=2.0)
    return {"threads": torch.get_num_threads(), "batch": batch, "context": context,
            "step_ms": round(ms, 2), "tokens_per_s": round(batch / ms * 1000, 1)}


def step_bytes(model: ServedModule, context: int) -> int:
    """Bytes a batch-1 step must move, as ``bench.roofline`` counts them: the native step's
    weights once as stored, except the embedding table (one row is gathered); the recurrent
    state and conv window, read and written back; the KV cache's ``context`` positions, read
    (not its capacity, which grows by doubling: 2,048 slots hold 1,024 tokens)."""
    plan = model.module.native_plan()
    assert plan is not None, "the model's step is not native"
    weights = plan.weights[1:]
    moved = sum(w.numel() * w.element_size() for w in weights)
    for e in state_at(model, 1, context).entries():
        if isinstance(e, KVEntry):
            moved += e.nbytes * context // e.capacity
        else:
            moved += 2 * e.nbytes
    return moved


def weight_bytes(model: ServedModule) -> int:
    return sum(p.numel() * p.element_size() for p in model.module.parameters())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """This project's figures (in process, no HTTP) at each thread count."""
    model = loader.load(args.checkpoint, args.dtype)
    assert isinstance(model, ServedModule)
    read = step_bytes(model, 1024)
    bw = read_bandwidth_gbs()
    rows, prefill = [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows += [decode_row(model, b, ctx) for ctx in args.contexts for b in args.batches
                 if b <= 8 or ctx <= 4096]
        model.prefill(torch.randint(0, 8000, (1, 64)))
        t0 = time.perf_counter()
        model.prefill(torch.randint(0, 8000, (1, args.prompt)))
        seconds = time.perf_counter() - t0
        prefill.append({"threads": threads, "tokens": args.prompt,
                        "tokens_per_s": round(args.prompt / seconds, 1),
                        "ttft_ms": round(seconds * 1000, 1)})
    one = next(r for r in rows if r["batch"] == 1 and r["threads"] == 1)
    session = {n: model.new_state(1).nbytes + n * kv_per_token(model)
               for n in (1024, 16_384, 131_072)}
    return {"decode": rows, "prefill": prefill, "weight_bytes": weight_bytes(model),
            "batch1_bytes_per_step": read, "read_gbs_1_thread": round(bw, 2),
            "batch1_roofline_ms": round(read / bw / 1e6, 2),
            "batch1_of_roofline": round(read / bw / 1e6 / one["step_ms"], 3),
            "session_bytes": session}


def compare_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    """llama-bench on each GGUF type, then 16 streams: llama-server against this server."""
    bench = {} if args.servers_only else {
        kind: lc.llama_bench(lc.gguf(args.checkpoint, kind), args.threads, args.prompt, 64)
        for kind in args.gguf}
    streams, prompt, gen = args.streams, 128, 128
    cmd, port = lc.llama_server_cmd(lc.gguf(args.checkpoint, "bf16"), streams, prompt + gen)
    theirs = lc.serve_and_load(cmd, port, streams, 3 * streams, prompt, gen,
                               RESULTS / "hf-llama-server.log")
    port = lc.free_port()
    ours_cmd = [sys.executable, "-m", "linserve", "serve", "--model", str(args.checkpoint),
                "--dtype", args.dtype, "--port", str(port), "--max-running", str(streams),
                "--threads", str(args.server_threads)]
    ours = lc.serve_and_load(ours_cmd, port, streams, 3 * streams, prompt, gen,
                             RESULTS / "hf-server.log")
    keep = ("output_tokens_per_s", "ttft_ms", "tpot_ms", "errors")
    return {"llama_bench": bench, "streams": streams, "server_threads": args.server_threads,
            "llama_server": {k: theirs.get(k) for k in keep},
            "ours_server": {k: ours.get(k) for k in keep}}


def kv_per_token(model: ServedModule) -> int:
    """Bytes one more token adds to a session (its KV entries)."""
    state = model.new_state(1)
    return sum(e.nbytes // e.capacity for e in state.entries() if isinstance(e, KVEntry))


def transformers_floor(path: Path, dtype: str, tokens: int = 32) -> float:
    """transformers' generate at batch 1: tokens/s of greedy decoding (after a warm-up)."""
    transformers: Any = importlib.import_module("transformers")
    ref = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    ids = torch.randint(0, 8000, (1, 16))
    ref.generate(ids, max_new_tokens=2, do_sample=False)
    t0 = time.perf_counter()
    ref.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return tokens / (time.perf_counter() - t0)


def plot(result: dict[str, Any]) -> None:
    """Batch-1 decode and prefill tokens/s, this server against llama.cpp per thread count."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    llama = result.get("llamacpp", {}).get("llama_bench", {})
    for ax, (test, ours_rows) in zip(axes, (
            ("tg64", [r for r in result["decode"] if r["batch"] == 1
                      and r["context"] == min(x["context"] for x in result["decode"])]),
            (f"pp{result['prefill'][0]['tokens']}", result["prefill"])), strict=True):
        labels = [f"this server, {r['threads']}t" for r in ours_rows]
        values = [r["tokens_per_s"] for r in ours_rows]
        for kind, rows in llama.items():
            for r in rows:
                if r["test"] == test:
                    labels.append(f"llama.cpp {kind}, {r['threads']}t")
                    values.append(r["tokens_per_s"])
        ax.barh(labels, values, color=["C0" if x.startswith("this") else "C1" for x in labels])
        ax.set_title("decode, batch 1" if test == "tg64" else f"prefill, {test[2:]} tokens")
        ax.set_xlabel("tokens/s (higher is better)")
        ax.grid(axis="x", alpha=0.3)
    save_figure(fig, "hf.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"))
    p.add_argument("--make", action="store_true", help="build the checkpoint first")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 16_384])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--llamacpp", action="store_true", help="compare with llama.cpp")
    p.add_argument("--gguf", nargs="+", default=["bf16", "f16", "q8_0", "f32"])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--server-threads", type=int, default=0,
                   help="this server's --threads (0: its default, all CPUs but one)")
    p.add_argument("--servers-only", action="store_true",
                   help="only the 16-stream comparison (bench/results/hf-servers.json)")
    args = p.parse_args(argv)
    if args.servers_only:
        result: dict[str, Any] = {"llamacpp": compare_llamacpp(args)}
        write_json("hf-servers", {"machine": machine(), "args": {
            **vars(args), "checkpoint": str(args.checkpoint)}, "result": result})
        print(result)
        return
    if args.make or not (args.checkpoint / "config.json").exists():
        make(args.checkpoint)
    result = measure(args)
    if not args.no_transformers:
        torch.set_num_threads(1)
        result["transformers_batch1_tokens_per_s"] = round(
            transformers_floor(args.checkpoint, args.dtype), 2)
    if args.llamacpp:
        result["llamacpp"] = compare_llamacpp(args)
    print_table(result["decode"], list(result["decode"][0]))
    print({k: v for k, v in result.items() if k != "decode"})
    write_json("hf", {"machine": machine(), "args": {**vars(args),
                                                     "checkpoint": str(args.checkpoint)},
                      "result": result})
    plot(result)


if __name__ == "__main__":
    main()
