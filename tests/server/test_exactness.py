"""Exact sessions and request handling over real HTTP: sessions hold exactly what the client
received, chat through a session equals the stateless chat, busy sessions cannot be deleted,
non-streaming requests are cancelled on disconnect, and smaller API fixes."""

from __future__ import annotations

import json
import struct
import time

import httpx
import pytest
from openai import OpenAI

from bench.serverproc import ServerProcess
from tests.reliability.helpers import metric

pytestmark = pytest.mark.integration
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"


def post(srv: ServerProcess, path: str, body: object) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_stop_string_is_trimmed_from_the_session(server: ServerProcess) -> None:
    """After a completion cut by a stop string, the session is "prompt + the text sent":
    its greedy continuation equals a stateless greedy completion of that very text."""
    sess = post(server, "/v1/sessions", {"prompt": PROMPT}).json()
    body = {"temperature": 0, "max_tokens": 60, "stop": ["\n\n"]}
    first = post(server, "/v1/completions", {**body, "prompt": "", "session_id": sess["id"]})
    sent = text_of(first)
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    info = httpx.get(f"{server.url}/v1/sessions/{sess['id']}").json()
    expected = len(post(server, "/tokenize", {"prompt": PROMPT + sent}).json()["tokens"])
    assert info["tokens"] == expected
    cont = {"temperature": 0, "max_tokens": 30, "ignore_eos": True}
    via_session = text_of(post(server, "/v1/completions",
                               {**cont, "prompt": "", "session_id": sess["id"]}))
    stateless = text_of(post(server, "/v1/completions", {**cont, "prompt": PROMPT + sent}))
    assert via_session == stateless


def test_chat_through_a_session_equals_the_stateless_chat(server: ServerProcess) -> None:
    """Three greedy turns with the openai SDK: through session_id (only the new message sent
    each turn) and statelessly (the whole history resent) give the same replies."""
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    turns = ["Who art thou?", "What news from Verona?", "Farewell, then."]
    sid = post(server, "/v1/sessions", {}).json()["id"]
    history: list[dict[str, str]] = [{"role": "system", "content": "A scene at court."}]
    first_turn = True
    for user in turns:
        history.append({"role": "user", "content": user})
        new = history if first_turn else history[-1:]
        first_turn = False
        kw = {"model": "linear", "max_tokens": 40, "temperature": 0}
        a = client.chat.completions.create(messages=new, extra_body={"session_id": sid},
                                           **kw)  # type: ignore[call-overload]
        b = client.chat.completions.create(messages=history, **kw)  # type: ignore[call-overload]
        assert a.choices[0].message.content == b.choices[0].message.content
        history.append({"role": "assistant", "content": b.choices[0].message.content or ""})


def test_chat_streaming_content_equals_non_streaming(server: ServerProcess) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    kw = {"model": "linear", "messages": [{"role": "user", "content": "Speak, friend."}],
          "max_tokens": 48, "temperature": 0}
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(stream=True, **kw) if c.choices]  # type: ignore[call-overload]
    assert "".join(parts) == whole.choices[0].message.content


def test_max_completion_tokens_is_honoured(server: ServerProcess) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    r = client.chat.completions.create(model="linear", max_completion_tokens=3,
                                       messages=[{"role": "user", "content": "Hail!"}],
                                       extra_body={"ignore_eos": True, "stop": ["zzzz"]})
    assert r.usage is not None and r.usage.completion_tokens <= 3


def test_busy_session_cannot_be_deleted(server: ServerProcess) -> None:
    """DELETE while a request runs is a 409; the running request still saves, and the
    session can be deleted (for good) afterwards."""
    sid = post(server, "/v1/sessions", {"prompt": PROMPT}).json()["id"]
    # long enough that the DELETE surely lands while it runs, however fast the step gets
    body = {"prompt": "", "session_id": sid, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        busy = httpx.delete(f"{server.url}/v1/sessions/{sid}")
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
        for _ in lines:
            pass
    time.sleep(0.1)
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens"] > 0
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}").status_code == 200
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").status_code == 404


def test_non_streaming_request_is_cancelled_on_disconnect(server: ServerProcess) -> None:
    """A client that gives up on a long non-streaming request frees its batch slot and its
    session at once; the session keeps its previous state (the client received nothing)."""
    sess = post(server, "/v1/sessions", {"prompt": PROMPT}).json()
    body = {"prompt": "", "session_id": sess["id"], "max_tokens": 8000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    t0 = time.monotonic()
    while metric(server.url, "linserve_num_requests_running") != 0:
        assert time.monotonic() - t0 < 3, "the abandoned request kept running"
        time.sleep(0.05)
    time.sleep(0.1)
    info = httpx.get(f"{server.url}/v1/sessions/{sess['id']}").json()
    assert info["tokens"] == sess["tokens"]
    again = post(server, "/v1/completions", {**body, "max_tokens": 2})
    assert again.status_code == 200  # not 409: the lock was released


def test_chunked_oversize_body_gets_413(server: ServerProcess) -> None:
    def chunks():  # no Content-Length: Transfer-Encoding chunked
        for _ in range(33 * 16):  # past the default 32 MiB
            yield b" " * 65536

    r = httpx.post(server.url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    small = httpx.post(server.url + "/v1/completions", timeout=30,
                       content=iter([json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()]),
                       headers={"content-type": "application/json"})
    assert small.status_code == 200


def test_health_is_split_into_liveness_and_readiness(server: ServerProcess) -> None:
    live = httpx.get(server.url + "/health/live")
    ready = httpx.get(server.url + "/health/ready")
    assert live.status_code == 200 and ready.status_code == 200
    health = httpx.get(server.url + "/health").json()
    engine = health["engine"]
    assert engine["status"] == "up" and isinstance(engine["pid"], int)
    # /health names the architecture as /v1/models does
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert health["architecture"] == model["architecture"] == "gated-linear"


def _with_tokens(blob: bytes, tokens: int) -> bytes:
    """The same state blob with its session token count rewritten."""
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    extra = json.loads(header["__metadata__"]["extra"])
    header["__metadata__"]["extra"] = json.dumps({**extra, "tokens": tokens})
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n :]


def test_softmax_import_checks_tokens_against_the_cache(softmax_server: ServerProcess) -> None:
    """A KV state whose token count disagrees with its cached length is refused at import
    (before: it passed, and failed the whole batch later)."""
    srv = softmax_server
    sess = post(srv, "/v1/sessions", {"prompt": PROMPT}).json()
    blob = httpx.get(f"{srv.url}/v1/sessions/{sess['id']}/state").content
    assert httpx.post(srv.url + "/v1/sessions/import", content=blob).status_code == 200
    for tokens in (sess["tokens"] + 50, sess["tokens"] - 3, 10**6):
        r = httpx.post(srv.url + "/v1/sessions/import", content=_with_tokens(blob, tokens))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_state"
