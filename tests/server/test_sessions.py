"""Sessions over real HTTP: continue, fork, export/import across processes, cancellation,
busy sessions and constant state size."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"


def post(srv: ServerProcess, path: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120, **kw)  # type: ignore[arg-type]


def complete(srv: ServerProcess, **body: object) -> dict:
    r = post(srv, "/v1/completions", {"temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def new_session(srv: ServerProcess, prompt: str = PROMPT) -> dict:
    r = post(srv, "/v1/sessions", {"prompt": prompt})
    assert r.status_code == 200, r.text
    return r.json()


def test_continuation_equals_one_long_request(server: ServerProcess) -> None:
    whole = complete(server, prompt=PROMPT, max_tokens=200)["choices"][0]["text"]
    sess = new_session(server)
    first = complete(server, prompt="", session_id=sess["id"], max_tokens=100)
    second = complete(server, prompt="", session_id=sess["id"], max_tokens=100)
    assert first["choices"][0]["text"] + second["choices"][0]["text"] == whole
    info = httpx.get(f"{server.url}/v1/sessions/{sess['id']}").json()
    assert info["tokens"] == sess["tokens"] + 200


def test_request_with_prompt_then_session_continuation(server: ServerProcess) -> None:
    whole = complete(server, prompt=PROMPT + "JULIET.\n", max_tokens=30)["choices"][0]["text"]
    sess = new_session(server)
    out = complete(server, prompt="JULIET.\n", session_id=sess["id"], max_tokens=30)
    assert out["choices"][0]["text"] == whole


def test_fork_diverges_independently(server: ServerProcess) -> None:
    sess = new_session(server)
    fork = post(server, f"/v1/sessions/{sess['id']}/fork", None).json()
    assert fork["id"] != sess["id"] and fork["tokens"] == sess["tokens"]
    a = complete(server, prompt="", session_id=fork["id"], max_tokens=20, temperature=1.0,
                 seed=1)["choices"][0]["text"]
    b = complete(server, prompt="", session_id=sess["id"], max_tokens=20)["choices"][0]["text"]
    fresh = complete(server, prompt=PROMPT, max_tokens=20)["choices"][0]["text"]
    assert b == fresh  # the parent is unaffected by the fork's progress
    assert a != b
    assert httpx.get(f"{server.url}/v1/sessions/{fork['id']}").json()["tokens"] == \
        sess["tokens"] + 20


def test_export_import_across_processes(server: ServerProcess, linear_weights: Path) -> None:
    sess = new_session(server)
    complete(server, prompt="", session_id=sess["id"], max_tokens=15)
    blob = httpx.get(f"{server.url}/v1/sessions/{sess['id']}/state").content
    expected = complete(server, prompt="", session_id=sess["id"], max_tokens=25)
    with ServerProcess(linear_weights) as other:
        r = httpx.post(other.url + "/v1/sessions/import", content=blob,
                       headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        imported = r.json()
        assert imported["tokens"] == sess["tokens"] + 15
        got = complete(other, prompt="", session_id=imported["id"], max_tokens=25)
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]


def test_delete_and_unknown(server: ServerProcess) -> None:
    sess = new_session(server)
    assert httpx.delete(f"{server.url}/v1/sessions/{sess['id']}").status_code == 200
    for method, path in [("GET", f"/v1/sessions/{sess['id']}"),
                         ("DELETE", f"/v1/sessions/{sess['id']}"),
                         ("POST", f"/v1/sessions/{sess['id']}/fork"),
                         ("GET", f"/v1/sessions/{sess['id']}/state")]:
        r = httpx.request(method, server.url + path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = post(server, "/v1/completions", {"prompt": "x", "session_id": sess["id"]})
    assert r.status_code == 404


def test_cancel_mid_stream_keeps_exactly_what_was_sent(server: ServerProcess) -> None:
    sess = new_session(server)
    full = complete(server, prompt=PROMPT, max_tokens=120)["choices"][0]["text"]
    body = {"prompt": "", "session_id": sess["id"], "max_tokens": 120, "stream": True,
            "temperature": 0, "ignore_eos": True, "logprobs": 0}
    received, text, rid = 0, "", ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                received += len(chunk["choices"][0]["logprobs"]["tokens"])
                text += chunk["choices"][0]["text"]
            if received >= 10:
                break  # drop the connection mid-stream
    deadline = time.time() + 5
    while httpx.get(f"{server.url}/v1/sessions/{sess['id']}").json()["busy"]:
        assert time.time() < deadline
        time.sleep(0.02)
    info = httpx.get(f"{server.url}/v1/sessions/{sess['id']}").json()
    # The session holds exactly what the server wrote before it saw the hang-up (its request
    # log says how many tokens; the client read some of them).
    record = server.request_record(rid)
    assert record is not None and record["status"] == "disconnected"
    held = info["tokens"] - sess["tokens"]
    assert held == record["output_tokens"] >= received
    assert full.startswith(text)
    # ...and its state is exactly "prompt + held tokens": a greedy continuation picks up the
    # uninterrupted text at that very point.
    upto = complete(server, prompt=PROMPT, max_tokens=held)["choices"][0]["text"]
    cont = complete(server, prompt="", session_id=sess["id"], max_tokens=20)["choices"][0]["text"]
    assert full.startswith(upto + cont)


def test_busy_session_gets_409(server: ServerProcess) -> None:
    sess = new_session(server)
    body = {"prompt": "", "session_id": sess["id"], "max_tokens": 8000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
        next(lines)
        second = post(server, "/v1/completions", {"prompt": "x", "session_id": sess["id"]})
        assert second.status_code == 409
        assert second.json()["error"]["code"] == "session_busy"


def test_state_bytes_constant(server: ServerProcess) -> None:
    small = new_session(server, "Hello")
    ids = list(range(100, 4100)) * 5  # 20,000 tokens
    big = post(server, "/v1/sessions", {"prompt": ids}).json()
    assert big["tokens"] == 20_000
    assert small["state_bytes"] == big["state_bytes"]
    complete(server, prompt="", session_id=big["id"], max_tokens=5)
    info = httpx.get(f"{server.url}/v1/sessions/{big['id']}").json()
    assert info["state_bytes"] == small["state_bytes"] and info["tokens"] == 20_005
    # ...and the bytes really held: the exported tensors of both are the same size (the
    # safetensors header, which carries the token count, aside).
    sizes = set()
    for sid in (small["id"], big["id"]):
        blob = httpx.get(f"{server.url}/v1/sessions/{sid}/state").content
        sizes.add(len(blob) - 8 - int.from_bytes(blob[:8], "little"))
    assert sizes == {small["state_bytes"]}
