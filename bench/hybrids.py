"""``python -m bench.hybrids``: the newest hybrids' batch-1 decode step, native against
layer by layer, and against the read roofline (issue 62; never run by CI).

For each model of :data:`bench.families.MODELS` named (published widths, random weights;
``--make`` builds a missing checkpoint as :func:`bench.families.make` does) and each weight
type: the checkpoint loaded in this process as the server loads it, a prompt of
``--context`` tokens prefilled, then the batch-1 step timed (the median of many) two ways:
the whole-model native call (``decoder_step.cpp``) and the eager step layer by layer
(``DecoderLM.step_eager``, what these families ran before), alternating (``speedup``: the
median round's eager ÷ native). The roofline fraction is the
bytes a token must read (every weight outside the experts and the chosen experts of each
MoE layer, as packed, plus the recurrent state read and written; :func:`bench.families.
active_bytes`) per native step time, over the native four-stream read of 512 MiB on the
same threads (``bench.gemv_read``'s ceiling), the two alternating ``--rounds`` times (this
VM's bandwidth drifts within minutes); the median round is kept. The best-of read of
:func:`bench.roofline.read_bandwidth_gbs` is recorded beside it.

Writes ``bench/results/hybrids.json`` and ``hybrids.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, save_figure, saved_models, time_ms, write_json
from bench.families import MODELS, active_bytes, make
from bench.quant import TYPES
from bench.roofline import read_bandwidth_gbs, stream_read
from linserve.model import loader
from linserve.model.served import ServedModule

DEFAULT = ["kimi-linear-48b-a3b-4l", "ling-6l-e64", "minimax-text-01-4l-e4",
           "olmo-hybrid-7b-8l", "lfm3"]


def state_bytes(model: Any, context: int) -> int:
    """Bytes of one row's recurrent state (read and written by a step) and of its KV
    caches up to ``context`` positions (read)."""
    state = model.new_state(1)
    total = 0
    for entry in state.entries():
        for name, t in entry.tensors().items():
            if t.numel() == 0:
                continue
            per_row = t[0].numel() * t.element_size()
            if name in ("k", "v"):  # a cache: the positions a step reads
                cap = max(t.shape[2], 1)
                total += per_row // cap * min(context, cap if getattr(entry, "window", 0)
                                              else context)
            else:
                total += 2 * per_row
    return total


def measure(path: Path, kind: str, context: int, rounds_of: int) -> dict[str, Any]:
    """One model under one weight type: native and eager step times at batch 1 and the
    stream read, alternating; the median round's roofline and the median speedup."""
    served = loader.load(path, "bfloat16", quantization=TYPES[kind])
    assert isinstance(served, ServedModule)
    module = served.module
    gen = torch.Generator().manual_seed(0)
    vocab = served.info.vocab_size
    _, state = served.prefill(torch.randint(0, vocab, (1, context), generator=gen))
    token = torch.randint(0, vocab, (1,), generator=gen)
    native_plan = module.native_plan() is not None

    def step() -> None:
        state.reserve_step(1)
        module.step(token, state)

    def eager() -> None:
        state.reserve_step(1)
        module.step_eager(token, state)

    read = stream_read()
    src = torch.ones(512 * 2**20 // 4)
    rounds = []
    with torch.inference_mode():
        for _ in range(rounds_of):  # the bandwidth drifts: each round times all three
            native_ms = time_ms(step, min_iters=20, min_seconds=2.0)
            eager_ms = time_ms(eager, min_iters=10, min_seconds=2.0)
            start = time.perf_counter()
            read(src)
            rounds.append((native_ms, eager_ms,
                           src.numel() * 4 / (time.perf_counter() - start) / 1e9))
    sizes = active_bytes(path, kind)
    nbytes = sizes["read_bytes"] + state_bytes(module, context)
    fractions = sorted((nbytes / (n / 1e3) / (gbs * 1e9), n, e, gbs) for n, e, gbs in rounds)
    roofline, native_ms, _, gbs = fractions[len(fractions) // 2]
    speedups = sorted(e / n for n, e, _ in rounds)
    return {"native": native_plan, "native_ms": native_ms,
            "eager_ms": sorted(e for _, e, _ in rounds)[len(rounds) // 2],
            "speedup": speedups[len(speedups) // 2], "read_bytes": nbytes,
            "stream_read_gbs": gbs, "roofline": roofline, "rounds": rounds,
            "params": sizes["params"], "active_params": sizes["active_params"],
            "decode_step": served.info.decode_step}


def plot(result: dict[str, Any]) -> None:
    """Each model's batch-1 step: native and eager ms, and the native step's roofline."""
    import matplotlib.pyplot as plt

    rows = [(f"{m} {k}", r) for m, entry in result["models"].items()
            for k, r in entry["types"].items()]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 2))
    names = [n for n, _ in rows]
    y = range(len(rows))
    axes[0].barh([i + 0.2 for i in y], [r["eager_ms"] for _, r in rows], 0.4,
                 label="layer by layer", color="C7")
    axes[0].barh([i - 0.2 for i in y], [r["native_ms"] for _, r in rows], 0.4,
                 label="one native call", color="C0")
    axes[0].set_yticks(list(y), names, fontsize=7)
    axes[0].set_xlabel("batch-1 step, ms")
    axes[0].legend(fontsize=7)
    axes[1].barh(list(y), [r["roofline"] for _, r in rows], color="C2")
    axes[1].axvline(0.8, color="black", lw=0.8, ls="--")
    axes[1].set_yticks(list(y), [""] * len(rows))
    axes[1].set_xlabel("of the read roofline (the stream read on the same threads)")
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("The newest hybrids at batch 1 (published widths, random weights)", fontsize=9)
    save_figure(fig, "hybrids")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=DEFAULT, choices=list(MODELS))
    p.add_argument("--root", type=Path, default=Path("/tmp"), help="where checkpoints live")
    p.add_argument("--make", action="store_true", help="build missing checkpoints first")
    p.add_argument("--kinds", nargs="+", default=["int8"], choices=list(TYPES))
    p.add_argument("--context", type=int, default=512, help="tokens before the timed steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    command = "python -m bench.hybrids " + " ".join(argv if argv is not None else sys.argv[1:])
    result = saved_models("hybrids")
    if args.plot_only:
        plot(result)
        return
    torch.set_num_threads(args.threads)
    read_gbs = read_bandwidth_gbs(threads=args.threads)
    table = []
    for name in args.models:
        path = args.root / name
        if not (path / "config.json").exists():
            if not args.make:
                raise SystemExit(f"{path} is missing: pass --make")
            make(name, path)
        entry: dict[str, Any] = result["models"].get(name) or {"types": {}}
        entry.update(command=command, machine=machine(), read_gbs=read_gbs)
        for kind in args.kinds:
            run = measure(path, kind, args.context, args.rounds)
            run["roofline_best_of_read"] = (run["read_bytes"] / (run["native_ms"] / 1e3)
                                            / (read_gbs * 1e9))
            entry["types"][kind] = run
            result["models"][name] = entry
            write_json("hybrids", {"result": result})
            table.append({"model": name, "kind": kind, "native": run["native"],
                          "native ms": round(run["native_ms"], 2),
                          "eager ms": round(run["eager_ms"], 2),
                          "speedup": round(run["speedup"], 2),
                          "GB read": round(run["read_bytes"] / 1e9, 3),
                          "read GB/s": round(run["stream_read_gbs"], 1),
                          "roofline": round(run["roofline"], 3),
                          "of best-of read": round(run["roofline_best_of_read"], 3)})
            print(table[-1], flush=True)
    print_table(table, list(table[0]))
    plot(result)


if __name__ == "__main__":
    main()
