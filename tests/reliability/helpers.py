"""Shared pieces of the reliability suite: bounded durations, RSS, metrics, stream clients."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import httpx

FULL = os.environ.get("LINSERVE_FULL") == "1"


def duration(ci_seconds: float, full_seconds: float) -> float:
    """CI runs the bounded version; LINSERVE_FULL=1 the full one."""
    return full_seconds if FULL else ci_seconds


def rss_bytes(pid: int) -> int:
    """Resident memory of a server: its process and its children (the engine process)."""
    from bench.sessions import rss_bytes as tree_rss

    return tree_rss(pid)


def metric(url: str, name: str) -> float:
    total = 0.0
    found = False
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise AssertionError(f"metric {name} missing")
    return total


def held_after(url: str, prompt: str | list[int], sent: int, **sampling: object) -> int:
    """How many tokens a session holds after a request that sent ``sent`` tokens: the same
    seeded request made without a session gives those tokens, and the session holds the
    tokens that spell their text (:func:`linserve.server.sessions.transcript.session_tokens`)."""
    from linserve.model.tokenizer import Tokenizer
    from linserve.server.sessions.transcript import session_tokens
    from tests.conftest import WEIGHTS

    if sent == 0:
        return 0
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": sent, "logprobs": 0, "return_tokens_as_token_ids": True,
        **sampling})
    r.raise_for_status()
    ids = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    tok = Tokenizer.from_file(WEIGHTS / "tokenizer.json")
    return len(session_tokens(tok, ids, tok.decode(ids)))


def wait_idle(url: str, timeout: float = 5.0) -> float:
    """Seconds until no request is running (raises if it takes longer than ``timeout``)."""
    t0 = time.monotonic()
    while metric(url, "linserve_num_requests_running") != 0:
        if time.monotonic() - t0 > timeout:
            raise AssertionError("requests still running")
        time.sleep(0.02)
    return time.monotonic() - t0


@dataclass
class StreamResult:
    id: str = ""
    status: int = 0
    done: bool = False
    finish_reason: str | None = None
    text: str = ""
    tokens: int = 0
    usage_tokens: int | None = None
    gaps: list[float] = field(default_factory=list)
    error: str = ""


async def stream(client: httpx.AsyncClient, url: str, body: dict, drop_after: int | None = None
                 ) -> StreamResult:
    """Stream one completion; with ``drop_after``, close the connection after that many
    tokens (counted through ``logprobs``)."""
    res = StreamResult()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode()
                return res
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    res.done = True
                    break
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                res.id = chunk.get("id", res.id)
                if chunk.get("usage"):
                    res.usage_tokens = chunk["usage"]["completion_tokens"]
                for ch in chunk.get("choices", []):
                    now = time.monotonic()
                    if last is not None:
                        res.gaps.append(now - last)
                    last = now
                    res.text += ch["text"]
                    res.finish_reason = ch["finish_reason"] or res.finish_reason
                    if ch.get("logprobs"):
                        res.tokens += len(ch["logprobs"]["tokens"])
                if drop_after is not None and res.tokens >= drop_after:
                    return res
    except httpx.HTTPError as exc:
        res.error = type(exc).__name__
    return res
