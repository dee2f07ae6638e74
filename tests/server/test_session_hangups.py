"""A session request that ends early, by a client hanging up mid-stream, by a stop string or
by a cancel before its first token, leaves the session free within a second, holding exactly
what the server sent: on every shipped model (recurrent, sliding-window and KV-cache states)
and on a tiny Qwen3.5 checkpoint (Gated DeltaNet beside a growing KV cache).

What the server wrote before it saw a hang-up is read from its own request log (a client
cannot know how much sat in socket buffers), so every check is exact."""

from __future__ import annotations

import functools
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.serverproc import ServerProcess
from linserve.model.tokenizer import Tokenizer
from linserve.server.sessions.transcript import session_tokens
from tests.conftest import WEIGHTS

pytestmark = pytest.mark.integration
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"
SHIPPED = ["linear", "linear-ungated", "softmax", "window", "favor"]


@functools.cache
def tok() -> Tokenizer:
    """The tokenizer every model here uses (the Qwen3.5 checkpoint is made with it too)."""
    return Tokenizer.from_file(WEIGHTS / "tokenizer.json")


@pytest.fixture(scope="module", params=[*SHIPPED, "qwen3_5"])
def srv(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[ServerProcess]:
    kind = request.param
    args = ["--max-running", "16"]
    if kind == "qwen3_5":
        pytest.importorskip("transformers")
        from tests.model.qwen_fixtures import make_checkpoint

        ckpt = make_checkpoint(tmp_path_factory.mktemp("qwen-hangup"), "i4-tied",
                               tokenizer="project")
        args += ["--model", str(ckpt)]
    elif not (WEIGHTS / kind / "model.safetensors").exists():
        pytest.skip(f"weights/{kind} is not shipped in this checkout")
    with ServerProcess(WEIGHTS / (kind if kind in SHIPPED else "linear"), args=args) as s:
        yield s


SEEDED = {"temperature": 0.8, "seed": 5, "ignore_eos": True}


def _session(srv: ServerProcess, prompt: str = PROMPT) -> dict:
    r = httpx.post(srv.url + "/v1/sessions", json={"prompt": prompt}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(logprobs: dict) -> list[int]:
    return [int(t.split(":")[1]) for t in logprobs["tokens"]]


def _complete_ids(srv: ServerProcess, prompt: str | list[int], max_tokens: int,
                  **body: object) -> list[int]:
    """The token ids of a stateless completion."""
    if max_tokens == 0:
        return []
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "logprobs": 0,
        "return_tokens_as_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return _ids(r.json()["choices"][0]["logprobs"])


def _state_is(srv: ServerProcess, sid: str, tokens: list[int]) -> None:
    """The session's state is exactly ``tokens``: its greedy continuation equals a stateless
    one from those tokens."""
    greedy = {"temperature": 0, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": "", "session_id": sid, "max_tokens": 8, "logprobs": 0,
        "return_tokens_as_token_ids": True, **greedy})
    assert r.status_code == 200, r.text
    assert _ids(r.json()["choices"][0]["logprobs"]) == _complete_ids(srv, tokens, 8, **greedy)


def _wait_free(srv: ServerProcess, sid: str, since: float) -> tuple[dict, float]:
    """Poll the session until no request holds it; (its info, seconds since ``since``)."""
    deadline = since + 10
    while True:
        info = httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()
        if not info["busy"] or time.monotonic() > deadline:
            return info, time.monotonic() - since
        time.sleep(0.01)


def _record(srv: ServerProcess, request_id: str) -> dict:
    deadline = time.monotonic() + 5
    while (rec := srv.request_record(request_id)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec is not None, f"no request record for {request_id}"
    return rec


def _stream_session(srv: ServerProcess, sid: str, chunks: int | None, **body: object
                    ) -> tuple[str, str, list[int], float]:
    """Stream a seeded request on the session, hanging up after ``chunks`` token chunks
    (None: read to the end). Returns (request id, text received, token ids received, the
    moment the connection closed)."""
    req = {"prompt": "", "session_id": sid, "max_tokens": 2000, "stream": True,
           "logprobs": 0, "return_tokens_as_token_ids": True, **SEEDED, **body}
    rid, text, ids, seen = "", "", [], 0
    with httpx.stream("POST", srv.url + "/v1/completions", json=req, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            for choice in chunk["choices"]:
                text += choice["text"]
                ids += _ids(choice.get("logprobs") or {"tokens": []})
            seen += 1
            if chunks is not None and seen >= chunks:
                break  # hang up mid-stream
    return rid, text, ids, time.monotonic()


@pytest.mark.parametrize("chunks", [1, 2, 7])
def test_a_hang_up_frees_the_session_holding_what_was_sent(srv: ServerProcess,
                                                           chunks: int) -> None:
    sess = _session(srv)
    rid, text, received, closed = _stream_session(srv, sess["id"], chunks)
    info, waited = _wait_free(srv, sess["id"], closed)
    assert not info["busy"] and waited < 1.0, waited
    sent = _record(srv, rid)["output_tokens"]
    # The same seeded request without a session gives the tokens the server sent.
    generated = _complete_ids(srv, PROMPT, sent, **SEEDED)
    assert len(received) <= sent and generated[:len(received)] == received
    assert tok().decode(generated).startswith(text)
    # The session holds the text of those tokens (a token cut inside a character is held as
    # the text the client got for it), and its state is exactly the prompt and them.
    held = session_tokens(tok(), generated, tok().decode(generated))
    assert info["tokens"] - sess["tokens"] == len(held)
    _state_is(srv, sess["id"], tok().encode(PROMPT) + held)


def test_a_stop_string_frees_the_session_holding_the_text_before_it(srv: ServerProcess
                                                                    ) -> None:
    ids = _complete_ids(srv, PROMPT, 60, **SEEDED)
    pieces = [tok().decode([t]) for t in ids]
    # A stop string made of two whole tokens that first occur at token j: the text before it
    # is exactly tokens [0, j), so the session must hold those j tokens.
    j = next(i for i in range(3, len(pieces) - 1)
             if "".join(pieces).find(pieces[i] + pieces[i + 1]) == len("".join(pieces[:i]))
             and "\ufffd" not in "".join(pieces[:i + 2]))
    stop, before = pieces[j] + pieces[j + 1], "".join(pieces[:j])
    sess = _session(srv)
    rid, text, _, closed = _stream_session(srv, sess["id"], None, stop=[stop])
    info, waited = _wait_free(srv, sess["id"], closed)
    assert not info["busy"] and waited < 1.0, waited
    assert text == before
    assert _record(srv, rid)["finish_reason"] == "stop"
    assert info["tokens"] - sess["tokens"] == j
    _state_is(srv, sess["id"], tok().encode(PROMPT) + ids[:j])


def test_a_cancel_before_the_first_token_leaves_the_session_as_it_was(srv: ServerProcess
                                                                     ) -> None:
    """The client sends a long prompt and closes the connection at once, having read nothing:
    whatever the server wrote by then (the log says; usually nothing) is what it keeps."""
    sess = _session(srv)
    body = json.dumps({"prompt": " Enter Ghost." * 300, "session_id": sess["id"],
                       "max_tokens": 500, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.01)
    closed = time.monotonic()
    info, waited = _wait_free(srv, sess["id"], closed)
    assert not info["busy"] and waited < 1.0, waited
    deadline = time.monotonic() + 5
    while (rec := _last_disconnect(srv)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec is not None
    if rec["output_tokens"] == 0:
        assert info["tokens"] == sess["tokens"]  # nothing sent: the session is untouched
    else:
        assert info["tokens"] > sess["tokens"] + rec["prompt_tokens"] - 1
    assert httpx.delete(f"{srv.url}/v1/sessions/{sess['id']}").status_code == 200


def _last_disconnect(srv: ServerProcess) -> dict | None:
    for line in reversed(srv.logs().splitlines()):
        start = line.find('{"event": "request"')
        if start >= 0 and '"status": "disconnected"' in line:
            rec: dict = json.loads(line[start:])
            return rec
    return None


def test_the_replay_queue_finishes_an_empty_job_at_once() -> None:
    """A replay with nothing to feed (a KV row cut back to exactly its target) finishes at
    once, even with no budget left, and never holds up the jobs behind it."""
    from linserve.server.engine.replay import Replay, ReplayQueue

    class Model:
        fed: list[int] = []  # noqa: RUF012

        def prefill_split(self, todo: int, cap: int, budget: int) -> int:
            return min(todo, cap, budget)

        def prefill(self, tokens, state):  # type: ignore[no-untyped-def]
            self.fed += tokens[0].tolist()
            return None, state

    done: list[str] = []
    queue = ReplayQueue(Model(), chunk=4)  # type: ignore[arg-type]
    for label, feed in (("empty", []), ("next", [1, 2, 3]), ("empty2", [])):
        queue.add(Replay(object(), feed, lambda _s, lb=label: done.append(lb),  # type: ignore[arg-type, misc]
                         lambda exc: None, label))
    assert queue.run(0) == 0 and done == ["empty"]  # no budget: the empty job still ends
    assert queue.run(8) == 5 and done == ["empty", "next", "empty2"]
    assert not queue
