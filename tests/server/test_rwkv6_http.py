"""RWKV-6 served as its users serve it: a BlinkDL ``.pth`` with a folder of state-tuned
files (``--state-dir``, ai00's named states), and a Q8_0 GGUF file from llama.cpp's converter.
A request naming a state continues as BlinkDL's reference does from that state and leaves
the state as it was; the names are listed; an unknown name, or a name with a session, is a
400; a state file of another model is one line at startup."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from bench.serverproc import ServerProcess
from tests.model import rwkv_fixtures
from tests.model.gguf_fixtures import convert

pytestmark = pytest.mark.integration
SHAPE = "d128-l3"


def _state_file(path: Path, shape: str, seed: int) -> Path:
    s = rwkv_fixtures.SHAPES6[shape]
    gen = torch.Generator().manual_seed(seed)
    torch.save({f"blocks.{i}.att.time_state":
                torch.randn(s["d"] // s["head"], s["head"], s["head"], generator=gen) * 2
                for i in range(s["layers"])}, path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("rwkv6-http")
    pth = rwkv_fixtures.write_pth_of(tmp / "model", rwkv_fixtures.blinkdl_weights6(SHAPE))
    states = tmp / "states"
    states.mkdir()
    _state_file(states / "poet.pth", SHAPE, 1)
    _state_file(states / "coder.pth", SHAPE, 2)
    return {"pth": pth, "states": states, "tmp": tmp}


@pytest.fixture(scope="module")
def srv(files: dict[str, Path]) -> Iterator[ServerProcess]:
    with ServerProcess.serving(files["pth"], "--served-model-name", "finch", "--state-dir",
                               str(files["states"])) as s:
        yield s


def _greedy(client: openai.OpenAI, ids: list[int], **extra: object) -> list[int]:
    out = client.completions.create(
        model="finch", prompt=ids, max_tokens=8, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **extra})
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return [int(t.split(":")[1]) for t in logprobs.tokens]


def test_a_named_state_starts_a_request_as_the_reference(srv: ServerProcess,
                                                          files: dict[str, Path]) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "Q: 2+2?\n\nA:"}).json()["tokens"]
    got = _greedy(client, ids, state="poet")
    ref = rwkv_fixtures.reference(files["pth"], ids, got[:-1], files["tmp"],
                                  state_file=files["states"] / "poet.pth")["logits"]
    assert [int(ref[len(ids) - 1 + i].argmax()) for i in range(len(got))] == got
    assert _greedy(client, ids, state="poet") == got  # the named state is left as it was
    assert _greedy(client, ids) != got and _greedy(client, ids, state="coder") != got
    plain = _greedy(client, ids)
    ref = rwkv_fixtures.reference(files["pth"], ids, plain[:-1], files["tmp"])["logits"]
    assert [int(ref[len(ids) - 1 + i].argmax()) for i in range(len(plain))] == plain
    chat = client.chat.completions.create(
        model="finch", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        extra_body={"state": "coder"})
    assert chat.choices[0].finish_reason in ("length", "stop")
    listed = httpx.get(srv.url + "/v1/states").json()["data"]
    assert sorted(s["id"] for s in listed) == ["coder", "poet"]


def test_an_unknown_name_or_one_with_a_session_is_a_400(srv: ServerProcess) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "state": "nobody"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "state_not_found"
        assert "coder, poet" in r.json()["error"]["message"]
        sid = c.post("/v1/sessions", json={"prompt": "Hi"}).json()["id"]
        r = c.post("/v1/completions", json={"prompt": "x", "state": "poet", "session_id": sid,
                                             "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "state"
        r = c.post("/v1/completions", json={"prompt": "x", "state": "poet", "n": 2,
                                             "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert c.get(f"/v1/sessions/{sid}").json()["tokens"] == 1
        r = c.post("/v1/sessions", json={"prompt": "Hi", "state": "nobody"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "state_not_found"


def test_a_session_starts_from_a_named_state(srv: ServerProcess) -> None:
    """A session made from a named state (with a prompt, or none) continues as a request
    from that state does."""
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "Q: 2+2?\n\nA:"}).json()["tokens"]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    want = _greedy(client, ids, state="poet")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        empty = c.post("/v1/sessions", json={"state": "poet"}).json()["id"]
        half = c.post("/v1/sessions", json={"state": "poet", "prompt": ids[:3]}).json()["id"]
    assert _greedy(client, ids, session_id=empty) == want
    assert _greedy(client, ids[3:], session_id=half) == want


def test_a_state_of_another_model_is_one_line_at_startup(files: dict[str, Path],
                                                        tmp_path: Path) -> None:
    bad = tmp_path / "states"
    bad.mkdir()
    _state_file(bad / "wide.pth", "d96-l2-h32", 1)
    run = subprocess.run([sys.executable, "-m", "linserve", "serve", "--model",
                          str(files["pth"]), "--state-dir", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "wide.pth" in run.stderr and "Traceback" not in run.stderr


def test_a_q8_0_gguf_serves(files: dict[str, Path]) -> None:
    """llama.cpp's converter's Q8_0 file of the same weights (rescaled every two layers):
    served natively, its greedy text within reach of the fp32 .pth's (same first token)."""
    folder = rwkv_fixtures.write_hf_rwkv(files["tmp"] / "hf", files["pth"], rescale_every=2)
    gguf = convert(folder, files["tmp"] / "model-q8_0.gguf", "q8_0", pre=None)
    with ServerProcess.serving(gguf) as s:
        health = httpx.get(s.url + "/health").json()
        assert health["decode_step"].startswith("fused")
        r = httpx.post(s.url + "/v1/completions", timeout=120, json={
            "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
