"""RWKV-7 served through HTTP as a user serves it: ``linserve serve --model model.pth`` (a
BlinkDL file with nothing beside it: the shipped world vocabulary and RWKV's chat format).
Greedy continuations equal to BlinkDL's reference through the openai SDK, chat, concurrent
requests equal to each alone, sessions with fork and export / import, structured outputs,
int8 weights."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from bench.serverproc import ServerProcess
from tests.model import rwkv_fixtures

pytestmark = pytest.mark.integration
SHAPE = "d128-l3"


@pytest.fixture(scope="module")
def pth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rwkv_fixtures.write_pth(tmp_path_factory.mktemp("rwkv-http"), SHAPE)


@pytest.fixture(scope="module")
def srv(pth: Path) -> Iterator[ServerProcess]:
    with ServerProcess.serving(pth, "--served-model-name", "goose") as s:
        yield s


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def test_greedy_continuation_is_the_references(srv: ServerProcess, pth: Path,
                                               tmp_path: Path) -> None:
    prompt = "The quick brown fox"
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    out = _client(srv).completions.create(
        model="goose", prompt=ids, max_tokens=12, temperature=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True}, logprobs=0)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    got = [int(t.split(":")[1]) for t in logprobs.tokens]
    ref = rwkv_fixtures.reference(pth, ids, got[:-1], tmp_path)["logits"]
    n = len(ids)
    assert [int(ref[n - 1 + i].argmax()) for i in range(len(got))] == got
    health = httpx.get(srv.url + "/health").json()
    assert health["decode_step"].startswith("fused")


def test_chat_uses_rwkvs_format(srv: ServerProcess) -> None:
    reply = _client(srv).chat.completions.create(
        model="goose", messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hello\n\nthere"}],
        max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None
    rendered = "System: Be brief.\n\nUser: Hello\nthere\n\nAssistant:"
    want = httpx.post(srv.url + "/tokenize", json={"prompt": rendered}).json()["tokens"]
    assert reply.usage.prompt_tokens == len(want)


def test_concurrent_requests_equal_each_alone(srv: ServerProcess) -> None:
    prompts = ["Once upon a time", "Σ is a sum; 你好", "def f(x):\n\treturn", "\n\n\n"]

    def run(p: str) -> str:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        return str(r.json()["choices"][0]["text"])

    alone = [run(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(run, prompts)) == alone


def test_sessions_fork_and_export_import_continue_like_stateless(srv: ServerProcess) -> None:
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        sess = c.post("/v1/sessions", json={"prompt": "User: hi\n\n"}).json()
        c.post("/v1/completions", json={"prompt": "Assistant:", "session_id": sess["id"],
                                         "max_tokens": 6, "temperature": 0,
                                         "ignore_eos": True})
        fork = c.post(f"/v1/sessions/{sess['id']}/fork").json()
        blob = c.get(f"/v1/sessions/{sess['id']}/state").content
        imported = c.post("/v1/sessions/import", content=blob,
                          headers={"content-type": "application/octet-stream"}).json()
        outs = [c.post("/v1/completions", json={
            "prompt": " more", "max_tokens": 8, "session_id": sid, "temperature": 0,
            "ignore_eos": True}).json()["choices"][0]["text"]
            for sid in (imported["id"], fork["id"], sess["id"])]
        assert outs[0] == outs[1] == outs[2]


def test_structured_output(srv: ServerProcess) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
              "required": ["n"], "additionalProperties": False}
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": "A number:", "max_tokens": 40, "guided_json": schema, "seed": 1})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def _greedy(url: str, ids: list[int], **extra: object) -> list[int]:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        "return_tokens_as_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_a_state_file_is_a_session_and_a_servers_initial_state(srv: ServerProcess, pth: Path,
                                                              tmp_path: Path) -> None:
    """An RWKV state-tuned file uploaded to ``/v1/sessions/import`` is a session that
    continues as the reference does from that state; exported with ``format=pth`` it is the
    file's tensors again (RWKV-Runner's format); ``--initial-state`` makes it where every
    request without a session starts, and a file of another model is one line at startup."""
    tuned = rwkv_fixtures.write_state_file(tmp_path / "tuned.pth", SHAPE)
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "Q: 2+2?\n\nA:"}).json()["tokens"]
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        sess = c.post("/v1/sessions/import", content=tuned.read_bytes(),
                      headers={"content-type": "application/octet-stream"})
        assert sess.status_code == 200, sess.text
        sid = sess.json()["id"]
        exported = c.get(f"/v1/sessions/{sid}/state", params={"format": "pth"}).content
        back = torch.load(io.BytesIO(exported), weights_only=True)
        for name, t in torch.load(tuned, weights_only=True).items():
            assert torch.equal(back[name], t)
        assert c.get(f"/v1/sessions/{sid}/state", params={"format": "xml"}).status_code == 400
    got = _greedy(srv.url, ids, session_id=sid)
    ref = rwkv_fixtures.reference(pth, ids, got[:-1], tmp_path, tuned)["logits"]
    assert [int(ref[len(ids) - 1 + i].argmax()) for i in range(len(got))] == got
    assert _greedy(srv.url, ids) != got  # the state matters
    with ServerProcess.serving(pth, "--initial-state", str(tuned)) as s:
        assert _greedy(s.url, ids) == got
    other = rwkv_fixtures.write_state_file(tmp_path / "other.pth", "d192-l2-h32")
    run = subprocess.run([sys.executable, "-m", "linserve", "serve", "--model", str(pth),
                          "--initial-state", str(other)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1
    assert "state file of 3 layers" in run.stderr and "Traceback" not in run.stderr


def test_a_model_without_state_files_says_so(server: ServerProcess) -> None:
    """The project's own model has no state-file format: exporting one, or importing an
    RWKV state file, is a 400 that says so, and the session is still there."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        sid = c.post("/v1/sessions", json={"prompt": "Hi"}).json()["id"]
        r = c.get(f"/v1/sessions/{sid}/state", params={"format": "pth"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_format"
        buf = io.BytesIO()
        torch.save({"blocks.0.att.time_state": torch.zeros(2, 64, 64)}, buf)
        r = c.post("/v1/sessions/import", content=buf.getvalue(),
                   headers={"content-type": "application/octet-stream"})
        assert r.status_code == 400 and "no state-file format" in r.json()["error"]["message"]
        assert c.get(f"/v1/sessions/{sid}").status_code == 200


def test_int8_weights_serve(pth: Path) -> None:
    with ServerProcess.serving(pth, "--quantization", "int8") as s:
        assert httpx.get(s.url + "/health").json()["quantization"] == "int8"
        r = httpx.post(s.url + "/v1/completions", timeout=120, json={
            "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
