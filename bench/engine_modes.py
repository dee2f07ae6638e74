"""``python -m bench.engine_modes``: the engine as a thread of the HTTP process against the
engine in its own process, with 1 and 2 torch threads, in one run.

64 streaming clients, 128 requests of 16-token prompts and 256 output tokens (the HTTP path
dominates), against the raw batch-64 step measured in the same run with no server up.
Writes ``bench/results/engine_modes.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import loadtest
from bench.common import machine, print_table, write_json
from bench.concurrency import raw_step_tokens_per_s
from bench.serverproc import ServerProcess

CONFIGS = [("thread", 1), ("thread", 2), ("process", 1), ("process", 2)]


def run_config(weights: Path, mode: str, threads: int, args: argparse.Namespace
               ) -> dict[str, Any]:
    server_args = ["--max-running", "64", "--engine-mode", mode, "--threads", str(threads)]
    with ServerProcess(weights, args=server_args) as srv:
        rep = loadtest.main(["--url", srv.url, "--concurrency", "64", "--requests",
                             str(args.requests), "--prompt-tokens", "16", "--max-tokens", "256",
                             "--ignore-eos", "--temperature", "0.8"])
    return {"engine": mode, "threads": threads, "tokens_per_s": rep["output_tokens_per_s"],
            "itl_p50_ms": rep["itl_ms"]["p50"], "ttft_p50_ms": rep["ttft_ms"]["p50"],
            "errors": rep["errors"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights/linear"))
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--output", default="engine_modes")
    args = p.parse_args(argv)
    rows = [run_config(args.weights, mode, threads, args) for mode, threads in CONFIGS]
    raw = raw_step_tokens_per_s(args.weights, 64, 16, 1)
    for row in rows:
        row["frac_of_raw_step_b64"] = row["tokens_per_s"] / raw
    print_table(rows, ["engine", "threads", "tokens_per_s", "itl_p50_ms", "ttft_p50_ms",
                       "frac_of_raw_step_b64", "errors"])
    print(write_json(args.output, {"machine": machine(), "raw_step_tokens_per_s_b64": raw,
                                   "rows": rows}))


if __name__ == "__main__":
    main()
