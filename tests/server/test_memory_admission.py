"""Admission by state bytes (``--max-memory``): with a budget that holds the KV caches of
about two long requests, a burst of long prompts queues and completes (or gets 429 past the
queue), the server never dies, and a request that could never fit is a 400."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.serverproc import ROOT, ServerProcess
from tests.model.qwen_fixtures import make_checkpoint

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")

PROMPT_TOKENS = 600
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    """A Qwen server whose budget holds the KV caches of two 608-token requests."""
    path = make_checkpoint(tmp_path_factory.mktemp("qwen-mem"), "i4-tied")
    probe = _info(path)
    per_request = probe["per_token"] * (PROMPT_TOKENS + MAX_TOKENS)
    fixed = probe["weight_bytes"] + probe["state_bytes"] * 4
    budget = fixed + int(2.5 * per_request)
    args = ["--model", str(path), "--dtype", "float32", "--max-memory", str(budget),
            "--max-running", "4", "--max-waiting", "4", "--prefix-cache-bytes", "0"]
    with ServerProcess(ROOT / "weights" / "linear", args=args) as srv:
        yield srv, per_request


def _info(path: Path) -> dict[str, int]:
    from linserve.model import loader

    info = loader.load(path, "float32").info
    return {"per_token": info.state_bytes_per_token, "weight_bytes": info.weight_bytes,
            "state_bytes": info.state_bytes}


def test_a_burst_of_long_prompts_queues_then_answers_429(
        tight_server: tuple[ServerProcess, int]) -> None:
    srv, _ = tight_server
    prompt = list(range(1, PROMPT_TOKENS + 1))

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True})
                for _ in range(12)))
        return [r.status_code for r in rs]

    codes = asyncio.run(burst())
    assert set(codes) <= {200, 429}
    assert codes.count(200) >= 2 and codes.count(429) >= 1
    assert httpx.get(srv.url + "/health").status_code == 200
    metrics = httpx.get(srv.url + "/metrics").text
    assert "linserve" in metrics


def test_a_request_that_could_never_fit_is_refused(tight_server: tuple[ServerProcess, int]
                                                   ) -> None:
    srv, _ = tight_server
    r = httpx.post(srv.url + "/v1/completions", json={
        "prompt": list(range(1, 200)), "max_tokens": 3000}, timeout=60)
    assert r.status_code == 400
    assert "--max-memory" in r.json()["error"]["message"]
