"""``python -m bench.context``: per-token decode latency and per-session state bytes against
context length (128 … 64k) at batch 1 and 32, for linear, gated linear, softmax and
sliding-window softmax (``--kinds``).

The recurrent kinds and the window model are measured at every length. Softmax stops where
its KV cache would exceed the memory budget (``--kv-budget``) or its maximum context; the
stopping point is marked on the plot.
Writes ``bench/results/context.json``, ``context_latency.png`` and ``context_state_bytes.png``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import RESULTS, machine, print_table, save_figure, style_axes, time_ms, write_json
from bench.step import KINDS, build, kv_bytes, state_at, step_fns

CONTEXTS = [128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
COLORS = {"linear": "tab:blue", "gated": "tab:green", "favor": "tab:purple",
          "softmax": "tab:red", "window": "tab:orange"}


def state_bytes(model: Any, context: int) -> int:
    """Bytes of one session's state after ``context`` tokens."""
    if model.cfg.is_recurrent:
        return int(model.new_state(1).nbytes)
    return kv_bytes(model.cfg, 1, context)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    rows = []
    for kind in args.kinds:
        model = build(kind, torch.float32, max(args.contexts) + 2, fused=True)
        for batch in args.batches:
            for ctx in args.contexts:
                row: dict[str, Any] = {"kind": kind, "batch": batch, "context": ctx,
                                       "state_bytes_per_session": state_bytes(model, ctx)}
                if kind == "softmax" and ctx > args.softmax_max_context:
                    row["stopped"] = f"over max_context {args.softmax_max_context}"
                elif kind == "softmax" and kv_bytes(model.cfg, batch, ctx) > args.kv_budget:
                    row["stopped"] = "KV cache over memory budget"
                else:
                    whole = time_ms(step_fns(model, state_at(model, batch, ctx), batch,
                                             compare_eager=False)["step"])
                    row["ms_per_step"] = whole
                    row["ms_per_token"] = whole / batch
                    print(f"{kind:8s} B={batch:3d} ctx={ctx:6d} step={whole:8.3f} ms", flush=True)
                rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], batches: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False)
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    for ax, batch in zip(axes[0], batches, strict=True):
        for kind in kinds:
            color = COLORS.get(kind)
            pts = [r for r in rows if r["kind"] == kind and r["batch"] == batch]
            done = [r for r in pts if "ms_per_step" in r]
            ax.plot([r["context"] for r in done], [r["ms_per_step"] for r in done], "o-",
                    color=color, label=kind)
            stopped = [r for r in pts if "stopped" in r]
            if stopped and done:
                ax.axvline(stopped[0]["context"], color=color, ls="--", alpha=0.6)
                ax.annotate(f"{kind} stops:\n{stopped[0]['stopped']}",
                            (stopped[0]["context"], done[-1]["ms_per_step"]), fontsize=8,
                            color=color, ha="right")
        style_axes(ax, "context (tokens)", "ms per decode step",
                   f"decode step latency, batch {batch}")
    save_figure(fig, "context_latency.png")
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for kind in kinds:
        pts = [r for r in rows if r["kind"] == kind and r["batch"] == batches[0]]
        ax.plot([r["context"] for r in pts], [r["state_bytes_per_session"] / 2**20 for r in pts],
                "o-", color=COLORS.get(kind), label=kind)
    style_axes(ax, "context (tokens)", "MiB of state per session", "session state size")
    save_figure(fig, "context_state_bytes.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["linear", "gated", "softmax", "window"],
                   choices=list(KINDS))
    p.add_argument("--contexts", nargs="+", type=int, default=CONTEXTS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-budget", type=float, default=8e9)
    p.add_argument("--softmax-max-context", type=int, default=65536,
                   help="cap for the timing run (the shipped model's is in its config)")
    args = p.parse_args(argv)
    rows = measure(args)
    print_table(rows, ["kind", "batch", "context", "ms_per_step", "ms_per_token",
                       "state_bytes_per_session", "stopped"])
    write_json("context", {"machine": machine(), "threads": args.threads, "rows": rows})
    plot(rows, args.batches)
    print(f"wrote {RESULTS}/context.json and PNG plots")


if __name__ == "__main__":
    main()
