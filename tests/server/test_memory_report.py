"""The memory report (``/health``'s ``memory``, ``linserve_memory_bytes``): its parts add up
to what ``/proc`` says the server's processes hold, and after a burst of long prompts the
server gives its scratch back."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.quant import rss_bytes
from bench.serverproc import ROOT, ServerProcess
from linserve.server.engine.memory import ENGINE_PARTS
from tests.model.qwen_fixtures import make_checkpoint

LIVE = ("slot_states", "kv_cache", "request_states", "prefix_cache", "sessions")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = make_checkpoint(tmp_path_factory.mktemp("qwen-memory"), "i4-tied")
    with ServerProcess.serving(path) as srv:
        yield srv


def _memory(srv: ServerProcess) -> dict[str, Any]:
    time.sleep(1.2)  # the engine reports its parts once a second
    body: dict[str, Any] = httpx.get(srv.url + "/health", timeout=10).json()["memory"]
    return body


def test_the_parts_add_up_to_the_processes_rss(qwen: ServerProcess) -> None:
    for _ in range(2):
        r = httpx.post(qwen.url + "/v1/completions", json={
            "prompt": "hello " * 50, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200
    mem = _memory(qwen)
    measured = rss_bytes(qwen.proc.pid)
    parts = mem["parts"]
    assert set(parts) == {*ENGINE_PARTS, "sessions", "runtime"}
    assert sum(parts.values()) == mem["rss"]["total"]
    assert abs(mem["rss"]["total"] - measured) <= 0.05 * measured
    assert mem["rss"]["engine"] > 0 and mem["rss"]["http"] > 0
    assert all(v >= 0 for v in parts.values())  # nothing named is counted beyond RSS
    info = httpx.get(qwen.url + "/health", timeout=10).json()
    assert parts["weights"] + parts["embeddings"] == info["weight_bytes"]
    assert parts["embeddings"] == 0  # tied: the table is the head
    assert parts["prefix_cache"] > 0  # the prompts' states are cached
    metrics = httpx.get(qwen.url + "/metrics", timeout=10).text
    for part in parts:
        assert f'linserve_memory_bytes{{part="{part}"}}' in metrics


def _long(srv: ServerProcess, i: int) -> int:
    r = httpx.post(srv.url + "/v1/completions", json={
        "prompt": f"{i} " + "the quick brown fox " * 300, "max_tokens": 16,
        "ignore_eos": True}, timeout=300)
    return r.status_code


def test_rss_falls_back_after_a_burst(qwen: ServerProcess) -> None:
    before = _memory(qwen)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: _long(qwen, i), range(16)))
    assert codes == [200] * 16
    time.sleep(1.0)
    after = _memory(qwen)

    def scratch(m: dict[str, Any]) -> int:
        return int(m["rss"]["total"]) - sum(int(m["parts"][p]) for p in LIVE)

    assert scratch(after) <= 1.1 * scratch(before), (before, after)


def test_the_report_is_there_without_an_engine_process(tmp_path: Path) -> None:
    with ServerProcess(ROOT / "weights" / "linear", args=["--engine-mode", "thread"]) as srv:
        mem = _memory(srv)
    assert mem["rss"]["engine"] == 0 and mem["parts"]["weights"] > 0
    assert sum(mem["parts"].values()) == mem["rss"]["total"]
