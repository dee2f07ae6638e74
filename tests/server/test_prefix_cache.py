"""The prefix cache over HTTP with the openai SDK, on the shipped linear weights: a stateless
multi-turn chat reports growing ``cached_tokens``, gives the same greedy replies as a server
with the cache off, and the metrics count it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from bench.serverproc import ServerProcess
from tests.reliability.helpers import metric

pytestmark = pytest.mark.integration


def chat(url: str, turns: int) -> list[tuple[str, int, int]]:
    """A stateless chat resending its whole history: (reply, prompt tokens, cached)."""
    client = OpenAI(base_url=url + "/v1", api_key="none")
    history = [{"role": "system", "content": "A hall in the castle. Enter the court."}]
    seen = []
    for i in range(turns):
        history.append({"role": "user", "content": f"Speak of the {i + 1}th omen, my lord."})
        r = client.chat.completions.create(model="linear", messages=history,  # type: ignore[arg-type]
                                           max_tokens=40, temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        reply = r.choices[0].message.content or ""
        seen.append((reply, r.usage.prompt_tokens,
                     r.usage.prompt_tokens_details.cached_tokens or 0))
        history.append({"role": "assistant", "content": reply})
    return seen


def test_stateless_chat_hits_the_cache_and_matches_no_cache(server: ServerProcess,
                                                            linear_weights: Path) -> None:
    on = chat(server.url, 5)
    with ServerProcess(linear_weights, args=["--prefix-cache-bytes", "0"]) as srv:
        off = chat(srv.url, 5)
        assert metric(srv.url, "linserve_prefix_cache_queries_total") == 0
    assert [r for r, _, _ in on] == [r for r, _, _ in off]
    assert all(cached == 0 for _, _, cached in off)
    for (_, prompt, cached), (_, before, _) in zip(on[1:], on, strict=False):
        # everything but the new user message (~15 tokens) comes from the cache
        assert before <= cached < prompt and prompt - cached <= 25, (prompt, cached)
    assert metric(server.url, "linserve_prefix_cache_hits_total") > 0
    assert metric(server.url, "linserve_prefix_cache_bytes") > 0
    assert 0 < metric(server.url, "linserve_prefix_cache_hit_rate") <= 1
    held = httpx.get(f"{server.url}/health").json()["prefix_cache"]
    assert held["entries"] > 0 and 0 < held["bytes"] <= held["budget_bytes"]
    assert 64 << 20 <= held["budget_bytes"] <= 4 << 30  # a share of --max-memory
    assert held["longest_tokens"] >= on[-1][1] - 25
