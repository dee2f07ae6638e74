"""Graceful shutdown: in-flight streams end cleanly with [DONE] before the deadline."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration


def test_sigterm_ends_streams_cleanly(linear_weights: Path) -> None:
    srv = ServerProcess(linear_weights, args=["--shutdown-grace-seconds", "3"])
    try:
        body = {"prompt": "Hark", "max_tokens": 8000, "stream": True, "ignore_eos": True}
        frames: list[str] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            t0 = time.monotonic()
            for i, line in enumerate(r.iter_lines()):
                if i == 2:
                    srv.proc.send_signal(signal.SIGTERM)
                if line:
                    frames.append(line)
        elapsed = time.monotonic() - t0
        assert frames[-1] == "data: [DONE]"
        last = json.loads(frames[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        assert elapsed < 10
        assert srv.proc.wait(15) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    finally:
        srv.stop()


def test_thread_engine_mode_serves(linear_weights: Path) -> None:
    """The engine can also run as a thread of the server process (for debugging)."""
    with ServerProcess(linear_weights, args=["--engine-mode", "thread"]) as srv:
        sess = httpx.post(srv.url + "/v1/sessions", json={"prompt": "Hark"}).json()
        body = {"prompt": "", "session_id": sess["id"], "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        info = httpx.get(f"{srv.url}/v1/sessions/{sess['id']}").json()
        assert info["tokens"] == sess["tokens"] + 5
        assert '"engine": "thread"' in srv.logs()
