"""``python -m bench.capacity``: how far one replica, one Redis and the design go.

Measured here, in one run:

1. **Redis's own throughput** for state-sized values: ``redis-benchmark`` (SET, then GET,
   16 clients) against a fresh ``redis-server`` on loopback, for a linear state (296 KiB)
   and a 4 MiB value (a 512-token softmax KV prefix; bigger ones scale by bytes).
2. **One replica's throughput on the target workload**: stateless multi-turn chat
   (``bench.multiturn``'s conversations: the whole history resent each turn, prefix cache
   on), 16 conversations of ``--turns`` turns at once, for the linear model and the softmax
   baseline: output tokens/s, and the bytes of a conversation's state after the mean history.

Then the model: ``N`` concurrent conversations, each sending a turn every ``--think``
seconds and reading ``--reply`` tokens back, with a history of ``--history`` tokens. Per
turn a replica publishes one prefix state to Redis (written once) and, with round-robin
routing, reads one back with probability (R-1)/R; with conversation-affine routing it reads
none (it holds the state). Replicas are sized at ``--utilisation`` of their measured tokens/s.
Redis becomes a Cluster when one node would hold more than ``--redis-node-gib`` or carry more
than half its measured bandwidth.

Writes ``bench/results/capacity.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import machine, plot_panels, print_table, write_json
from bench.multiturn import conversations
from bench.serverproc import ServerProcess, free_port

GIB = 1024**3
SIZES = {"linear state (296 KiB)": 303_104, "softmax 512-token KV (4 MiB)": 4 * 1024**2}


def redis_throughput(requests: int) -> list[dict[str, Any]]:
    """SET and GET ops/s and bytes/s of ``redis-benchmark`` for each value size."""
    server, bench = shutil.which("redis-server"), shutil.which("redis-benchmark")
    if server is None or bench is None:
        raise SystemExit("needs redis-server and redis-benchmark (apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                 "", "--appendonly", "no", "--dir", tmp],
                                stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        rows = []
        try:
            for name, size in SIZES.items():
                n = max(200, requests * 303_104 // size)
                out = subprocess.run([bench, "-p", str(port), "-t", "set,get", "-d", str(size),
                                      "-n", str(n), "-c", "16", "--csv", "-q"],
                                     capture_output=True, text=True, check=True).stdout
                for line in out.splitlines()[1:]:
                    cells = [c.strip('"') for c in line.split(",")]
                    ops = float(cells[1])
                    rows.append({"value": name, "op": cells[0], "bytes": size,
                                 "ops_per_s": ops, "mib_per_s": ops * size / 1024**2})
        finally:
            proc.terminate()
            proc.wait(10)
    return rows


def replica_throughput(weights: Path, turns: int, reply: int) -> dict[str, Any]:
    """One replica on stateless multi-turn chat: output tokens/s and the state's bytes."""
    with ServerProcess(weights, args=["--max-running", "64"]) as srv:
        convs, wall = asyncio.run(conversations(srv.url, 16, turns, reply))
        rows = [r for c in convs for r in c if "ttft_ms" in r]
        history = max(r["prompt_tokens"] for r in rows)
        ids = [(i * 7919) % 8000 + 100 for i in range(history)]
        info = httpx.post(srv.url + "/v1/sessions", json={"prompt": ids}, timeout=300).json()
    cfg = json.loads((weights / "config.json").read_text())
    return {"model": weights.name, "output_tokens_per_s": sum(r["output_tokens"] for r in rows)
            / wall, "history_tokens": history, "state_bytes": info["state_bytes"],
            "kv_bytes_per_token": 2 * cfg["n_layers"] * cfg["d_model"] * 4}


def state_bytes(model: dict[str, Any], history: int) -> float:
    """A conversation's state after ``history`` tokens: constant (linear), or keys and values
    of every token (softmax: 2 · layers · d_model fp32 values a token; the live cache holds
    up to twice that, as it grows by doubling)."""
    if model["model"] == "softmax":
        return float(model["kv_bytes_per_token"] * history)
    return float(model["state_bytes"])


def plan(model: dict[str, Any], n: int, redis_bw: float, args: argparse.Namespace
         ) -> dict[str, Any]:
    """Replicas, memory and Redis traffic for ``n`` concurrent conversations."""
    turns_per_s = n / args.think
    replicas = math.ceil(turns_per_s * args.reply / (model["output_tokens_per_s"]
                                                     * args.utilisation))
    size = state_bytes(model, args.history)
    per_replica = n / replicas * size  # every conversation's state, hot in its replica
    write = turns_per_s * size
    read_rr = write * (replicas - 1) / replicas if replicas > 1 else 0.0
    redis_mem = n * size
    shards = max(math.ceil(redis_mem / (args.redis_node_gib * GIB)),
                 math.ceil((write + read_rr) / (0.5 * redis_bw)))
    return {"model": model["model"], "conversations": n, "turns_per_s": turns_per_s,
            "replicas": replicas, "state_mib": size / 1024**2,
            "hot_states_gib_per_replica": per_replica / GIB,
            "redis_gib": redis_mem / GIB,
            "redis_write_mib_s": write / 1024**2,
            "redis_read_mib_s_round_robin": read_rr / 1024**2,
            "redis_read_mib_s_affinity": 0.0,
            "redis_shards": shards, "redis_cluster": shards > 1}


def plot(plans: list[dict[str, Any]]) -> None:
    """Replicas, Redis memory and Redis traffic against conversations, per model."""
    plot_panels("capacity.png", plans, "conversations", "model",
                [("replicas", "replicas (2 cores each)"), ("redis_gib", "Redis memory (GiB)"),
                 ("redis_write_mib_s", "Redis writes (MiB/s)")], "concurrent conversations",
                logy=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights"))
    p.add_argument("--turns", type=int, default=8, help="turns per measured conversation")
    p.add_argument("--reply", type=int, default=100, help="output tokens per turn")
    p.add_argument("--think", type=float, default=60.0, help="seconds between turns")
    p.add_argument("--history", type=int, default=2000, help="mean tokens of history")
    p.add_argument("--utilisation", type=float, default=0.7)
    p.add_argument("--redis-node-gib", type=float, default=64.0)
    p.add_argument("--redis-requests", type=int, default=2000)
    p.add_argument("--output", default="capacity")
    args = p.parse_args(argv)
    redis_rows = redis_throughput(args.redis_requests)
    print_table(redis_rows, ["value", "op", "ops_per_s", "mib_per_s"])
    # One node's bandwidth for the traffic mix (a write and, at most, a read per turn).
    per_op = [r["mib_per_s"] * 1024**2 for r in redis_rows if r["bytes"] == 303_104]
    redis_bw = 2 / sum(1 / b for b in per_op)  # harmonic mean of SET and GET
    models = [replica_throughput(args.weights / m, args.turns, args.reply)
              for m in ("linear", "softmax")]
    print_table(models, ["model", "output_tokens_per_s", "history_tokens", "state_bytes"])
    plans = [plan(m, n, redis_bw, args) for m in models for n in (10_000, 100_000, 1_000_000)]
    print_table(plans, ["model", "conversations", "replicas", "state_mib",
                        "hot_states_gib_per_replica", "redis_gib", "redis_write_mib_s",
                        "redis_read_mib_s_round_robin", "redis_shards"])
    plot(plans)
    print(write_json(args.output, {"machine": machine(), "assumptions": vars(args) | {
        "weights": str(args.weights)}, "redis": redis_rows, "redis_bytes_per_s": redis_bw,
        "replica": models, "plans": plans}))


if __name__ == "__main__":
    main()
