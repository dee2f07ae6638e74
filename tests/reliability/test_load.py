"""Soak, disconnect storm, overload and slow readers against the real server.

CI runs bounded versions; ``LINSERVE_FULL=1`` runs the full ones (RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.serverproc import ServerProcess
from tests.reliability.helpers import (
    FULL,
    StreamResult,
    duration,
    held_after,
    metric,
    rss_bytes,
    stream,
    wait_idle,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(1800)  # the full run lasts 10 minutes plus warm-up
def test_soak(linear_weights: Path) -> None:
    """64 concurrent streaming clients for 60 s (10 min full): 0 errors, every stream ends
    with [DONE] and the right finish_reason, RSS growth after warm-up < 5%."""
    seconds = duration(60, 600)
    # A small prefix cache fills during the warm-up, so the measured part runs in its steady
    # state: inserting and evicting entries must not grow memory either.
    args = ["--max-running", "64", "--prefix-cache-bytes", str(32 << 20)]
    with ServerProcess(linear_weights, args=args) as srv:
        async def client_loop(i: int, until: float, out: list) -> None:
            rng = random.Random(i)
            async with httpx.AsyncClient(timeout=120) as c:
                while time.monotonic() < until:
                    n = rng.randint(8, 64)
                    body = {"prompt": f"Scene {rng.randint(0, 999)}.", "max_tokens": n,
                            "stream": True, "ignore_eos": True, "temperature": 0.9,
                            "stream_options": {"include_usage": True}}
                    out.append((n, await stream(c, srv.url, body)))

        async def run(secs: float) -> list:
            out: list = []
            until = time.monotonic() + secs
            await asyncio.gather(*(client_loop(i, until, out) for i in range(64)))
            return out
        def settled_rss() -> float:
            """RSS once the burst is over and the engine has given its scratch back (it
            trims its heap when a burst ends): both readings in the same state, so a
            reading taken just before the trim does not count as growth."""
            wait_idle(srv.url, timeout=30.0)
            time.sleep(1.0)
            return rss_bytes(srv.proc.pid) - metric(srv.url, "linserve_prefix_cache_bytes")

        asyncio.run(run(min(10.0, seconds / 6)))  # warm-up
        rss0 = settled_rss()
        results = asyncio.run(run(seconds))
        rss1 = settled_rss()
    bad = [r for _, r in results if r.status != 200 or not r.done or r.error]
    assert not bad, bad[:3]
    assert all(r.finish_reason == "length" and r.usage_tokens == n for n, r in results)
    growth = (rss1 - rss0) / rss0
    print(f"soak: {len(results)} streams in {seconds}s, RSS less the prefix cache's budgeted "
          f"bytes {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB ({growth:+.1%})")
    assert growth < 0.05


def test_disconnect_storm(linear_weights: Path) -> None:
    """300 clients drop mid-stream at random points: nothing keeps running (within 1 s of
    the last drop), no memory or sessions leak, sessions hold exactly what was sent."""
    n_clients = 300
    with ServerProcess(linear_weights, args=["--max-running", "64", "--max-waiting",
                                             "512"]) as srv:
        sessions = [httpx.post(srv.url + "/v1/sessions", json={"prompt": f"Act {i}."}).json()
                    for i in range(30)]

        async def one(i: int, c: httpx.AsyncClient) -> tuple[int, StreamResult]:
            rng = random.Random(i)
            body = {"prompt": "Enter Ghost.", "max_tokens": 2000, "stream": True,
                    "ignore_eos": True, "logprobs": 0}
            if i < len(sessions):
                body = {**body, "prompt": "", "session_id": sessions[i]["id"], "seed": i}
            res = await stream(c, srv.url, body, drop_after=rng.randint(1, 40))
            return i, res

        async def storm(first: int) -> list[tuple[int, StreamResult]]:
            async with httpx.AsyncClient(timeout=120,
                                         limits=httpx.Limits(max_connections=400)) as c:
                return await asyncio.gather(*(one(i, c) for i in range(first, n_clients)))
        asyncio.run(storm(len(sessions)))  # warm-up storm: allocator pools, connections
        wait_idle(srv.url, timeout=5.0)
        rss0 = rss_bytes(srv.proc.pid)
        received = dict(asyncio.run(storm(0)))
        settle = wait_idle(srv.url, timeout=5.0)
        assert settle < 1.0, settle
        for i, sess in enumerate(sessions):
            # The session holds exactly what the server wrote before it saw the hang-up (its
            # request log counts it; the client parsed some of it): the tokens of the same
            # seeded request made without a session.
            record = srv.request_record(received[i].id)
            assert record is not None and record["status"] == "disconnected", i
            sent = record["output_tokens"]
            assert received[i].tokens <= sent, (i, sent)
            held = httpx.get(f"{srv.url}/v1/sessions/{sess['id']}").json()["tokens"]
            want = held_after(srv.url, f"Act {i}.", sent, seed=i, ignore_eos=True)
            assert held - sess["tokens"] == want, (i, held, sent)
        assert metric(srv.url, "linserve_sessions") == len(sessions)
        cache = "linserve_prefix_cache_bytes"  # budgeted, not a leak
        rss1 = rss_bytes(srv.proc.pid) - metric(srv.url, cache)
        asyncio.run(storm(len(sessions)))  # a leak grows again; allocator warm-up does not
        wait_idle(srv.url, timeout=5.0)
        rss2 = rss_bytes(srv.proc.pid) - metric(srv.url, cache)
        print(f"storm: settled in {settle * 1000:.0f} ms; RSS {rss0 / 2**20:.0f} -> "
              f"{rss1 / 2**20:.0f} -> {rss2 / 2**20:.0f} MiB over three storms")
        assert rss2 < rss1 * 1.03
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}
                          ).status_code == 200


PROBE = """
import json, sys, time, http.client
port, seconds = int(sys.argv[1]), float(sys.argv[2])
out, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/health")
    status = c.getresponse().status
    c.close()
    out.append((status, time.monotonic() - t0))
    time.sleep(0.05)
print(json.dumps(out))
"""


def test_overload_4x_capacity(linear_weights: Path) -> None:
    """4x capacity at once: the excess gets 429 + Retry-After (never a hang or a 500), and
    /health answers within 100 ms (p99) throughout, probed from a separate process."""
    import subprocess
    import sys

    cap_running, cap_waiting = 16, 16
    args = ["--max-running", str(cap_running), "--max-waiting", str(cap_waiting)]
    with ServerProcess(linear_weights, args=args) as srv:
        probe = subprocess.Popen([sys.executable, "-c", PROBE, str(srv.port), "8"],
                                 stdout=subprocess.PIPE, text=True)

        async def main() -> list:
            async with httpx.AsyncClient(timeout=120,
                                         limits=httpx.Limits(max_connections=200)) as c:
                body = {"prompt": "Alarum.", "max_tokens": 200, "stream": True,
                        "ignore_eos": True}
                return await asyncio.gather(*(stream(c, srv.url, body)
                                              for _ in range(4 * (cap_running + cap_waiting))))
        results = asyncio.run(main())
        import json

        health = json.loads(probe.communicate(timeout=60)[0])
    codes = [r.status for r in results]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 2 * (cap_running + cap_waiting)
    assert all(r.done for r in results if r.status == 200)
    assert all(status == 200 for status, _ in health)
    p99 = float(np.percentile([t for _, t in health], 99))
    print(f"overload: {codes.count(200)} served, {codes.count(429)} refused; "
          f"/health p99 {p99 * 1000:.1f} ms over {len(health)} probes")
    assert p99 < 0.1


def raw_reader(port: int, body: bytes, seconds: float, slow: bool) -> None:
    """A client that reads one byte per second (``slow``) or everything at once."""
    s = socket.create_connection(("127.0.0.1", port))
    if slow:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not s.recv(1 if slow else 65536):
            break
        if slow:
            time.sleep(1.0)
    s.close()


def itl_with_background(srv: ServerProcess, slow: bool, seconds: float) -> float:
    """Time per token of 8 measured clients (the median over them of each one's time from
    its first streamed chunk to its last, over its tokens after the first) while 8
    background clients stream. Not the median gap between chunks: the 8 fast background
    readers are threads of this process, and while they hold the GIL the measured clients'
    chunks arrive bunched (gaps near 0 beside one long one), which lowered the fast load's
    median gap and not the slow one's; a client's whole span does not depend on that."""
    import threading

    bg = b'{"prompt": "Dirge.", "max_tokens": 8000, "stream": true, "ignore_eos": true}'
    threads = [threading.Thread(target=raw_reader, args=(srv.port, bg, seconds, slow))
               for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    body = {"prompt": "Music.", "max_tokens": 300, "stream": True, "ignore_eos": True,
            "temperature": 0}

    async def measure() -> float:
        async with httpx.AsyncClient(timeout=120) as c:
            res = await asyncio.gather(*(stream(c, srv.url, body) for _ in range(8)))
        assert all(r.done for r in res), [r.error for r in res]
        return float(np.median([sum(r.gaps) / (body["max_tokens"] - 1) for r in res]))
    itl = asyncio.run(measure())
    for t in threads:
        t.join()
    wait_idle(srv.url, timeout=30)
    return itl


def test_slow_readers_do_not_slow_others(linear_weights: Path) -> None:
    """8 clients reading 1 byte/s beside 8 measured clients, against 8 fast readers beside
    them: the same batch size, so any difference is the slow readers' doing.

    The two loads alternate three times and each keeps its best round, so a burst of other
    work on the machine during one round does not read as the slow readers' cost. (With the
    median gap between chunks as the measure, a round read ~3.0 or ~4.6 ms with either load,
    and a full CI run once drew [3.12, 4.53] / [4.77, 4.73] ms: see itl_with_background.)"""
    secs = duration(8, 60)
    fast, slow = [], []
    with ServerProcess(linear_weights) as srv:
        for _ in range(3):
            fast.append(itl_with_background(srv, slow=False, seconds=secs))
            slow.append(itl_with_background(srv, slow=True, seconds=secs))
    ratio = min(slow) / min(fast)
    print(f"slow readers: time per token {min(fast) * 1000:.2f} ms with fast readers, "
          f"{min(slow) * 1000:.2f} ms with 1 byte/s readers ({ratio:.2f}x); "
          f"rounds {[round(t * 1000, 2) for t in fast]} / {[round(t * 1000, 2) for t in slow]}")
    assert ratio < (1.10 if FULL else 1.5)  # CI: a bounded, noisier run
