"""The softmax baseline serves and refuses past its maximum context; API keys isolate
sessions."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from bench.serverproc import ServerProcess
from linserve.model.own_config import ModelConfig

pytestmark = pytest.mark.integration


def test_softmax_streams_and_refuses_past_max_context(softmax_server: ServerProcess,
                                                      softmax_weights: Path) -> None:
    c = openai.OpenAI(base_url=softmax_server.url + "/v1", api_key="x", max_retries=0)
    chunks = list(c.completions.create(model="x", prompt="Now is the winter", max_tokens=10,
                                       stream=True, temperature=0,
                                       extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    max_ctx = ModelConfig.load(softmax_weights / "config.json").max_context
    r = httpx.post(softmax_server.url + "/v1/completions",
                   json={"prompt": [5] * (max_ctx - 4), "max_tokens": 10})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    sess = httpx.post(softmax_server.url + "/v1/sessions", json={"prompt": "Hi"}).json()
    grown = httpx.post(softmax_server.url + "/v1/completions", timeout=60, json={
        "prompt": [7] * 600, "session_id": sess["id"], "max_tokens": 1}).json()
    assert grown["usage"]["completion_tokens"] == 1
    info = httpx.get(f"{softmax_server.url}/v1/sessions/{sess['id']}").json()
    assert info["state_bytes"] > sess["state_bytes"]  # the KV cache grows
    r = httpx.post(softmax_server.url + "/v1/completions", json={
        "prompt": [7] * (max_ctx - 600), "session_id": sess["id"], "max_tokens": 5})
    assert r.status_code == 400


def test_api_keys_isolate_sessions(linear_weights: Path) -> None:
    env = {"LINSERVE_API_KEYS": "key-a,key-b"}
    with ServerProcess(linear_weights, env=env) as srv:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer no"}
                         ).status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        sess = httpx.post(srv.url + "/v1/sessions", json={"prompt": "Hi"}, headers=a).json()
        sid = sess["id"]
        calls = [("GET", f"/v1/sessions/{sid}", None), ("POST", f"/v1/sessions/{sid}/fork", None),
                 ("GET", f"/v1/sessions/{sid}/state", None),
                 ("POST", "/v1/completions", {"prompt": "x", "session_id": sid}),
                 ("DELETE", f"/v1/sessions/{sid}", None)]
        for method, path, body in calls:
            r = httpx.request(method, srv.url + path, json=body, headers=b)
            assert r.status_code == 404, (method, path, r.text)
            assert json.loads(r.text)["error"]["type"] == "not_found_error"
        assert httpx.get(f"{srv.url}/v1/sessions/{sid}", headers=a).status_code == 200
        oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="key-a", max_retries=0)
        assert oa.completions.create(model="x", prompt="Hi", max_tokens=2).choices


def test_cors_closed_by_default(server: ServerProcess) -> None:
    r = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
