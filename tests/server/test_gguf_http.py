"""Serving a GGUF file as a user does (``linserve serve model.gguf``): a Qwen3.5 checkpoint
with its published tokenizer and chat template, converted by llama.cpp's converter, then
stored Q4_0 (its matrices run on their own blocks). Through the openai SDK: greedy text
equal to the safetensors original's for the F32 file, chat with the file's own template,
streaming, sessions, structured outputs, and the Anthropic Messages API."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gguf import GGMLQuantizationType

from bench.serverproc import ROOT, ServerProcess
from tests.model import gguf_fixtures
from tests.model.qwen_fixtures import make_checkpoint

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-http")
    hf = make_checkpoint(root / "qwen", "i4-tied")
    f32 = gguf_fixtures.convert(hf, root / "qwen-f32.gguf", pre=None, extra=("--no-mtp",))
    q4 = gguf_fixtures.requantize(
        f32, root / "qwen-q4_0.gguf", lambda name, shape: GGMLQuantizationType.Q4_0
        if len(shape) == 2 and shape[-1] % 32 == 0 and "ssm_" not in name else None)
    return {"hf": hf, "f32": f32, "q4_0": q4}


def _serve(model: Path, *args: str) -> ServerProcess:
    return ServerProcess(ROOT / "weights" / "linear", ready_timeout=120,
                         command=[sys.executable, "-m", "linserve", "serve", str(model)],
                         args=["--served-model-name", "tiny", *args])


@pytest.fixture(scope="module")
def q4(files: dict[str, Path]) -> Iterator[ServerProcess]:
    with _serve(files["q4_0"], "--dtype", "auto") as srv:
        yield srv


def test_the_f32_file_answers_as_its_safetensors_do(files: dict[str, Path]) -> None:
    """Greedy completions and chat from the F32 file equal the folder's, token for token,
    served side by side."""
    from openai import OpenAI

    with _serve(files["f32"], "--dtype", "float32") as a, \
            _serve(files["hf"], "--dtype", "float32") as b:
        for srv_a, srv_b in ((a, b),):
            ca = OpenAI(base_url=srv_a.url + "/v1", api_key="none", max_retries=0)
            cb = OpenAI(base_url=srv_b.url + "/v1", api_key="none", max_retries=0)
            for prompt in ("The capital of France is", "def add(a, b):"):
                ra = ca.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                           temperature=0, logprobs=1)
                rb = cb.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                           temperature=0, logprobs=1)
                assert ra.choices[0].text == rb.choices[0].text
            msgs = [{"role": "user", "content": "Say hi."}]
            ta = ca.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,  # type: ignore[arg-type]
                                            temperature=0)
            tb = cb.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,  # type: ignore[arg-type]
                                            temperature=0)
            assert ta.choices[0].message.content == tb.choices[0].message.content
            assert ta.usage is not None and tb.usage is not None
            assert ta.usage.prompt_tokens == tb.usage.prompt_tokens  # the same template


def test_health_says_what_the_file_holds(q4: ServerProcess) -> None:
    health = httpx.get(q4.url + "/health").json()
    assert health["status"] == "ok"
    assert "qwen3_5" in health["architecture"]
    log = q4.log_path.read_text()
    assert "Q4_0 matrices run on their own blocks" in log


def test_chat_streams_and_sessions_keep_state(q4: ServerProcess) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=q4.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=12, temperature=0)
    assert "".join(pieces) == whole.choices[0].message.content
    sid = httpx.post(q4.url + "/v1/sessions", json={"prompt": "One, two,"}).json()["id"]
    first = httpx.post(q4.url + "/v1/completions", json={
        "model": "tiny", "prompt": " three,", "max_tokens": 6, "temperature": 0,
        "session_id": sid}).json()
    assert first["choices"][0]["text"]
    assert first["usage"]["prompt_tokens"] <= 3  # only the new text: the rest is the state


def test_structured_output_and_messages_api(q4: ServerProcess) -> None:
    from openai import OpenAI

    # the integer's digits bounded: a random model may write digits until max_tokens
    schema = {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}},
              "required": ["n"], "additionalProperties": False}
    client = OpenAI(base_url=q4.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A number."}], max_tokens=30,
        response_format={"type": "json_schema",  # type: ignore[arg-type,misc]
                         "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].message.content or "")["n"] in (1, 2, 3)
    msg = httpx.post(q4.url + "/v1/messages", json={
        "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
    assert msg.status_code == 200 and msg.json()["content"][0]["type"] == "text"


def test_kv_cache_dtypes_serve_and_say_so(files: dict[str, Path], q4: ServerProcess) -> None:
    """``--kv-cache-dtype``: the Q4_0 file's cache is bf16 by default (its weights are
    quantized), the F32 file's fp32; ``int8`` holds 9/32 of fp32's bytes a token. An int8
    server answers, keeps a session, and a session exported from it continues the same on
    a server that reads it into an fp32 cache (what was stored, read back)."""
    info = httpx.get(q4.url + "/v1/models").json()["data"][0]
    assert info["kv_cache_dtype"] == "bf16"
    with _serve(files["f32"], "--dtype", "float32", "--kv-cache-dtype", "int8") as int8, \
            _serve(files["f32"], "--dtype", "float32") as fp32:
        mine = httpx.get(int8.url + "/v1/models").json()["data"][0]
        theirs = httpx.get(fp32.url + "/v1/models").json()["data"][0]
        assert (mine["kv_cache_dtype"], theirs["kv_cache_dtype"]) == ("int8", "fp32")
        assert mine["state_bytes_per_token"] * 32 == theirs["state_bytes_per_token"] * 9
        ask = {"model": "tiny", "prompt": "One, two, three, four,", "max_tokens": 8,
               "temperature": 0}
        assert httpx.post(int8.url + "/v1/completions", json=ask).json()["choices"][0]["text"]
        sid = httpx.post(int8.url + "/v1/sessions", json={"prompt": "One, two,"}).json()["id"]
        blob = httpx.get(f"{int8.url}/v1/sessions/{sid}/state").content
        more = {"model": "tiny", "prompt": " three,", "max_tokens": 6, "temperature": 0}
        here = httpx.post(int8.url + "/v1/completions",
                          json={**more, "session_id": sid}).json()
        r = httpx.post(fp32.url + "/v1/sessions/import", content=blob,
                       headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        there = httpx.post(fp32.url + "/v1/completions",
                           json={**more, "session_id": r.json()["id"]}).json()
        assert here["usage"]["prompt_tokens"] == there["usage"]["prompt_tokens"]
        assert there["choices"][0]["text"]
