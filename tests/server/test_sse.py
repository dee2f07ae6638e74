"""Raw SSE framing, keep-alives and finish reasons, checked with httpx."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration


def raw_events(url: str, body: dict[str, object]) -> tuple[httpx.Headers, list[str]]:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
        return r.headers, text.split("\n\n")


def test_exact_framing_and_done(server: ServerProcess) -> None:
    headers, frames = raw_events(server.url + "/v1/completions", {
        "prompt": "Friends, Romans,", "max_tokens": 8, "stream": True, "temperature": 0,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-accel-buffering"] == "no"
    assert frames[-1] == ""  # the stream ends with a blank line
    assert frames[-2] == "data: [DONE]"
    payloads = [f for f in frames[:-2] if not f.startswith(":")]
    assert all(f.startswith("data: {") for f in payloads)
    chunks = [json.loads(f[len("data: "):]) for f in payloads]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_across_tokens_is_excluded(server: ServerProcess) -> None:
    base = {"prompt": "KING.\nWhat say you?\n\n", "max_tokens": 60, "temperature": 0,
            "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=base, timeout=60).json()
    text = full["choices"][0]["text"]
    assert len(text) > 12
    stop = text[5:9]  # a string that occurs, probably spanning a token boundary
    cut = httpx.post(server.url + "/v1/completions", json={**base, "stop": [stop]},
                     timeout=60).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    _, frames = raw_events(server.url + "/v1/completions", {**base, "stop": stop,
                                                             "stream": True})
    streamed = "".join(json.loads(f[6:])["choices"][0]["text"] for f in frames
                       if f.startswith("data: {"))
    assert streamed == cut["choices"][0]["text"]


def test_stop_token_ids_and_finish_reason(server: ServerProcess) -> None:
    base = {"prompt": "HAMLET.\n", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json={**base, "logprobs": 0},
                      timeout=60).json()
    toks = full["choices"][0]["logprobs"]["tokens"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": toks[3]}).json()["tokens"]
    if len(ids) != 1:
        pytest.skip("token string does not round-trip to one id")
    out = httpx.post(server.url + "/v1/completions",
                     json={**base, "stop_token_ids": ids}, timeout=60).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] <= 4
