"""``python -m bench.token_budget``: the per-iteration token budget's trade-off.

``--step-token-budget`` (vLLM's ``--max-num-batched-tokens``) caps the prompt tokens the
engine prefills in one iteration, beside that iteration's decode step. A large budget feeds
prompts fast (short TTFT) but makes every running stream wait for the whole prefill (long
inter-token gaps); a small one keeps decode steady and queues prompts longer.

For each budget, one linear server (``--prefill-chunk`` = min(budget, 512)) under
``bench.loadtest`` with 1,000-token prompts and 256 output tokens, at 16 and 64 streaming
clients (the concurrency sweep's workload, BENCHMARKS.md §4): output tokens/s, ITL p50 and
p99, TTFT p50. Writes ``bench/results/token_budget.json`` and ``token_budget.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import loadtest
from bench.common import machine, plot_panels, print_table, write_json
from bench.serverproc import ServerProcess


def run(weights: Path, budget: int, clients: int, dtype: str, args: argparse.Namespace
        ) -> dict[str, Any]:
    server_args = ["--max-running", "64", "--max-waiting", "256", "--step-token-budget",
                   str(budget), "--prefill-chunk", str(min(budget, 512)), "--dtype", dtype]
    with ServerProcess(weights, args=server_args) as srv:
        rep = loadtest.main(["--url", srv.url, "--concurrency", str(clients), "--requests",
                             str(2 * clients), "--prompt-tokens", str(args.prompt_tokens),
                             "--max-tokens", str(args.max_tokens), "--ignore-eos",
                             "--temperature", "0.8"])
    return {"budget": budget, "clients": clients, "dtype": dtype,
            "tokens_per_s": rep["output_tokens_per_s"],
            "itl_p50_ms": rep["itl_ms"]["p50"], "itl_p99_ms": rep["itl_ms"]["p99"],
            "ttft_p50_ms": rep["ttft_ms"]["p50"], "errors": rep["errors"]}


def plot(rows: list[dict[str, Any]], name: str) -> None:
    rows = [{**r, "series": f"{r['clients']} clients, {r['dtype']}"} for r in rows]
    plot_panels(f"{name}.png", rows, "budget", "series",
                [("itl_p99_ms", "ITL p99 (ms)"), ("tokens_per_s", "output tokens/s"),
                 ("ttft_p50_ms", "TTFT p50 (ms)")],
                "prompt tokens per iteration (--step-token-budget)", logx=2,
                label=str)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights/linear"))
    p.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
    p.add_argument("--clients", nargs="+", type=int, default=[16, 64])
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtypes", nargs="+", default=["auto"],
                   help="server --dtype values to run (auto: what the server picks here)")
    p.add_argument("--output", default="token_budget")
    args = p.parse_args(argv)
    rows = [run(args.weights, b, c, d, args) for d in args.dtypes for c in args.clients
            for b in args.budgets]
    print_table(rows, ["dtype", "budget", "clients", "tokens_per_s", "itl_p50_ms", "itl_p99_ms",
                       "ttft_p50_ms"])
    plot(rows, args.output)
    print(write_json(args.output, {"machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
