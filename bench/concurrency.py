"""``python -m bench.concurrency``: aggregate tokens/s and inter-token latency against the
number of concurrent streaming clients, for the linear server and the softmax baseline.

For each model it starts the real server, then sweeps 1, 4, 16, 64 and 128 clients with
``--prompt-tokens`` prompts and ``--max-tokens`` outputs through ``bench.loadtest``
(``--waves`` requests per client), and records the CPU each output token cost the HTTP
process, the engine process and the load generator (``/proc`` and ``getrusage``). In the
same run it measures the raw batched ``step`` throughput at batch 64 in-process (with the
server stopped), so the HTTP figure can be quoted as a fraction of it. Writes
``bench/results/concurrency.json`` and ``concurrency.png``.
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path
from typing import Any

import torch

from bench import loadtest
from bench.common import (
    RESULTS,
    child_pids,
    cpu_seconds,
    machine,
    print_table,
    save_figure,
    style_axes,
    time_ms,
    write_json,
)
from bench.serverproc import ServerProcess
from linserve.model.architectures.own_model import load_model
from linserve.server.engine.loading import pick_dtype


def raw_step_tokens_per_s(weights: Path, batch: int, context: int, threads: int,
                          dtype: str = "auto") -> float:
    """Tokens/s of the bare batched step (sampling-free), in this process, with the weight
    dtype the server loads for ``--dtype`` (auto: bf16 where the CPU has it)."""
    torch.set_num_threads(threads)
    model = load_model(weights, getattr(torch, pick_dtype(dtype)[0]))
    return batch / step_ms(model, batch, context) * 1000


def step_ms(model: Any, batch: int, context: int) -> float:
    """Milliseconds of ``model``'s bare batched step (any served model): ``batch`` rows
    after a ``context``-token prompt, at the same position every time."""
    from linserve.model.state import State

    _, one = model.prefill(torch.randint(0, 8000, (1, context)))
    state = State.cat([one.copy() for _ in range(batch)])
    state.reserve(context + 64)
    tokens = torch.randint(0, 8000, (batch,))

    def step() -> None:
        model.step(tokens, state)
        state.lengths -= 1  # the same position every time

    return time_ms(step, min_seconds=1.0)


def sweep(weights: Path, levels: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    server_args = ["--max-running", str(max(levels)), "--max-waiting", str(4 * max(levels)),
                   "--dtype", args.dtype]
    with ServerProcess(weights, args=server_args) as srv:
        for n in levels:
            before = cpu_split(srv.proc.pid)
            rep = loadtest.main(["--url", srv.url, "--concurrency", str(n), "--requests",
                                 str(max(args.waves * n, 8)),
                                 "--prompt-tokens", str(args.prompt_tokens),
                                 "--max-tokens", str(args.max_tokens), "--ignore-eos",
                                 "--temperature", "0.8"])
            tokens = max(1, rep["output_tokens"])
            cpu = {k: (v - before[k]) / tokens * 1e6
                   for k, v in cpu_split(srv.proc.pid).items()}
            rows.append({"model": weights.name, "concurrency": n,
                         "tokens_per_s": rep["output_tokens_per_s"],
                         "itl_p50_ms": rep["itl_ms"]["p50"], "itl_p99_ms": rep["itl_ms"]["p99"],
                         "ttft_p50_ms": rep["ttft_ms"]["p50"], "errors": rep["errors"],
                         **{f"cpu_us_per_token_{k}": round(v, 1) for k, v in cpu.items()}})
    return rows


def cpu_split(server_pid: int) -> dict[str, float]:
    """CPU seconds so far of the HTTP process, the engine process (its children) and this
    process, which runs the load generator."""
    return {"http": cpu_seconds(server_pid),
            "engine": sum(cpu_seconds(c) for c in child_pids(server_pid)),
            "loadgen": resource.getrusage(resource.RUSAGE_SELF).ru_utime
            + resource.getrusage(resource.RUSAGE_SELF).ru_stime}


def plot(rows: list[dict[str, Any]], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for model, color in (("linear", "tab:blue"), ("softmax", "tab:red")):
        pts = [r for r in rows if r["model"] == model]
        xs = [r["concurrency"] for r in pts]
        a1.plot(xs, [r["tokens_per_s"] for r in pts], "o-", color=color, label=model)
        a2.plot(xs, [r["itl_p50_ms"] for r in pts], "o-", color=color, label=f"{model} p50")
        a2.plot(xs, [r["itl_p99_ms"] for r in pts], "s--", color=color, alpha=0.6,
                label=f"{model} p99")
    for ax, title, ylabel in ((a1, "aggregate output tokens/s", "tokens/s"),
                              (a2, "inter-token latency", "ms")):
        style_axes(ax, "concurrent streaming clients", ylabel, title, logy=False)
    save_figure(fig, f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", nargs="+", type=int, default=[1, 4, 16, 64, 128])
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--models", nargs="+", default=["linear", "softmax"])
    p.add_argument("--weights", type=Path, default=Path("weights"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="the server's --dtype (and the raw step's)")
    p.add_argument("--waves", type=int, default=2,
                   help="requests per client: more waves weigh the ramp-up and tail less")
    p.add_argument("--output", default="concurrency", help="name of the JSON and PNG written")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    raw = {}
    for model in args.models:
        rows += sweep(args.weights / model, args.levels, args)
        raw[model] = raw_step_tokens_per_s(args.weights / model, 64, args.prompt_tokens,
                                           args.threads, args.dtype)
    for r in rows:
        r["frac_of_raw_step_b64"] = r["tokens_per_s"] / raw[r["model"]]
    print_table(rows, ["model", "concurrency", "tokens_per_s", "frac_of_raw_step_b64",
                       "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "cpu_us_per_token_http",
                       "cpu_us_per_token_engine", "cpu_us_per_token_loadgen"])
    write_json(args.output, {"machine": machine(), "raw_step_tokens_per_s_b64": raw,
                             "rows": rows})
    plot(rows, args.output)
    print(f"wrote {RESULTS}/{args.output}.json and {args.output}.png")


if __name__ == "__main__":
    main()
