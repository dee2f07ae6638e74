"""``python -m bench.sessions``: memory held by idle sessions in the in-memory store.

Starts the server, prefills one session of ``--tokens`` tokens, exports its state, and
imports it ``--count`` times: every import allocates its own tensors, exactly as a session
prefilled from its own prompt would (prefilling 10,000 × 2,000 tokens would take an hour
and measure prefill, not memory). Reports server RSS before and after, and bytes per
session, for linear, and for softmax as far as it fits (``--softmax-budget``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.common import RESULTS, machine, print_table, rss_bytes, write_json
from bench.serverproc import ServerProcess


def fill(weights: Path, count: int, tokens: int, budget: float) -> dict[str, Any]:
    args = ["--session-memory-bytes", str(64 * 2**30), "--max-prompt-tokens",
            str(max(tokens, 32768))]
    with ServerProcess(weights, args=args) as srv, httpx.Client(timeout=120) as c:
        ids = [(i * 7919) % 8000 + 100 for i in range(tokens)]
        sess = c.post(srv.url + "/v1/sessions", json={"prompt": ids}).json()
        blob = c.get(f"{srv.url}/v1/sessions/{sess['id']}/state").content
        per_session = sess["state_bytes"]
        n = min(count, int(budget // max(per_session, 1)))
        before = rss_bytes(srv.proc.pid)
        for _ in tqdm(range(n), desc=weights.name):
            r = c.post(srv.url + "/v1/sessions/import", content=blob)
            assert r.status_code == 200, r.text
        after = rss_bytes(srv.proc.pid)
        return {"model": weights.name, "sessions": n, "tokens_each": tokens,
                "state_bytes_each": per_session, "rss_before": before, "rss_after": after,
                "rss_added": after - before, "rss_added_per_session": (after - before) / n,
                "extrapolated_10k_gb": (after - before) / n * 10_000 / 1e9}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--softmax-budget", type=float, default=6e9,
                   help="bytes of softmax sessions to create at most")
    p.add_argument("--weights", type=Path, default=Path("weights"))
    args = p.parse_args(argv)
    rows = [fill(args.weights / "linear", args.count, args.tokens, 1e12),
            fill(args.weights / "softmax", args.count, args.tokens, args.softmax_budget)]
    print_table(rows, ["model", "sessions", "tokens_each", "state_bytes_each", "rss_added",
                       "rss_added_per_session", "extrapolated_10k_gb"])
    write_json("sessions", {"machine": machine(), "rows": rows})
    print(f"wrote {RESULTS}/sessions.json")


if __name__ == "__main__":
    main()
