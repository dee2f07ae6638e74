"""The FAVOR+ model and bf16 weights served end to end: streaming through the openai SDK,
and a session continued in two requests equals one long request (greedy)."""

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


@pytest.fixture(scope="module", params=["favor", "linear-bf16"])
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
