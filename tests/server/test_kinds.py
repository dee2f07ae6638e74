"""The other shipped kinds served end to end (FAVOR+, the sliding-window softmax baseline,
and bf16 weights): streaming through the openai SDK, a session continued in two requests
equals one long request (greedy), and a session cut by a stop string continues from exactly
the text it returned. The long prompt runs the window model's ring past its W slots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from bench.serverproc import ServerProcess
from tests.conftest import _weights

pytestmark = pytest.mark.integration
PROMPT = "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\n"
LONG = PROMPT + "ROMEO.\nShall I hear more, or shall I speak at this?\n" * 24


@pytest.fixture(scope="module", params=["favor", "window", "linear-bf16"])
def kind_server(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    kind, _, dtype = str(request.param).partition("-")
    weights: Path = _weights(kind, tmp_path_factory)
    args = ["--dtype", "bfloat16"] if dtype else []
    with ServerProcess(weights, args=args) as srv:
        yield srv


def test_streams_through_the_sdk(kind_server: ServerProcess) -> None:
    client = OpenAI(base_url=kind_server.url + "/v1", api_key="none")
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=12,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_session_continuation_equals_one_request(kind_server: ServerProcess) -> None:
    url = kind_server.url
    greedy = {"temperature": 0, "ignore_eos": True}
    whole = httpx.post(url + "/v1/completions", timeout=120,
                       json={**greedy, "prompt": PROMPT, "max_tokens": 40}).json()
    sid = httpx.post(url + "/v1/sessions", json={"prompt": PROMPT}).json()["id"]
    parts = [httpx.post(url + "/v1/completions", timeout=120, json={
        **greedy, "prompt": "", "session_id": sid, "max_tokens": 20}).json()["choices"][0]["text"]
        for _ in range(2)]
    assert "".join(parts) == whole["choices"][0]["text"]


def test_long_session_cut_by_a_stop_string_continues_from_its_text(
        kind_server: ServerProcess) -> None:
    """A stop string makes the server rebuild the session's state to the returned text (a
    window model's ring cannot be cut back, so it replays from its prompt snapshot)."""
    url = kind_server.url
    greedy = {"temperature": 0, "ignore_eos": True}
    sampled = {"temperature": 0.8, "seed": 3, "ignore_eos": True, "max_tokens": 30}
    probe = httpx.post(url + "/v1/completions", timeout=120, json={
        **sampled, "prompt": LONG}).json()["choices"][0]["text"]
    words = [w for w in probe[len(probe) // 3 :].split() if len(w) >= 2]
    assert words, probe
    stop = words[0][:2]
    sid = httpx.post(url + "/v1/sessions", json={"prompt": LONG}).json()["id"]
    first = httpx.post(url + "/v1/completions", timeout=120, json={
        **sampled, "prompt": "", "session_id": sid, "stop": [stop]}).json()
    assert first["choices"][0]["finish_reason"] == "stop"
    cut = first["choices"][0]["text"]
    assert probe.startswith(cut) and len(cut) < len(probe)
    follow = {**greedy, "max_tokens": 20}
    went_on = httpx.post(url + "/v1/completions", timeout=120, json={
        **follow, "prompt": "", "session_id": sid}).json()["choices"][0]["text"]
    fresh = httpx.post(url + "/v1/completions", timeout=120, json={
        **follow, "prompt": LONG + cut}).json()["choices"][0]["text"]
    assert went_on == fresh
