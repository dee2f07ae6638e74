"""Many concurrent streaming clients, and overload answered with 429."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration


async def stream_text(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str, str]:
    text, reason = "", ""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.text, ""
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice:
                    text += choice[0]["text"]
                    reason = choice[0]["finish_reason"] or reason
            elif line == "data: [DONE]":
                return 200, text, reason
    return -1, text, reason  # stream ended without [DONE]


def test_32_concurrent_clients_match_solo_runs(server: ServerProcess) -> None:
    prompts = [f"SCENE {i}.\nEnter a Messenger.\n" + "Ay, " * (i % 7) for i in range(32)]
    bodies = [{"prompt": p, "max_tokens": 24 + (i % 5) * 8, "temperature": 0, "stream": True,
               "ignore_eos": True} for i, p in enumerate(prompts)]

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(timeout=300) as c:
            url = server.url + "/v1/completions"
            together = await asyncio.gather(*(stream_text(c, url, b) for b in bodies))
            alone = [await stream_text(c, url, b) for b in bodies[:8]]
            return list(together), alone
    together, alone = asyncio.run(run())
    assert all(code == 200 and reason == "length" for code, _, reason in together)
    for a, t in zip(alone, together[:8], strict=False):
        assert a[1] == t[1]


def test_flood_beyond_capacity_gets_429(linear_weights: Path) -> None:
    args = ["--max-running", "2", "--max-waiting", "2"]
    with ServerProcess(linear_weights, args=args) as srv:
        body = {"prompt": "Now is the winter", "max_tokens": 3000, "stream": True,
                "ignore_eos": True}

        async def run() -> list[tuple[int, str, str]]:
            async with httpx.AsyncClient(timeout=120) as c:
                url = srv.url + "/v1/completions"
                tasks = [asyncio.create_task(stream_text(c, url, body)) for _ in range(12)]
                await asyncio.sleep(0.5)
                health = await c.get(srv.url + "/health")
                assert health.status_code == 200
                return await asyncio.gather(*tasks)
        results = asyncio.run(run())
        codes = [r[0] for r in results]
        assert codes.count(429) >= 6 and codes.count(200) >= 2, codes
        rejected = next(r for r in results if r[0] == 429)
        err = json.loads(rejected[1])["error"]
        assert err["type"] == "rate_limit_error"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200


def test_retry_after_header(linear_weights: Path) -> None:
    with ServerProcess(linear_weights, args=["--max-running", "1", "--max-waiting", "0"]) as srv:
        body = {"prompt": "Now", "max_tokens": 8000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            second = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"
