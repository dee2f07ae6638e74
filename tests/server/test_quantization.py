"""``--quantization int8|int4`` through the real server: /health and the startup log report
it with the resident weight bytes; the openai SDK gets completions; a seeded request gives
the same text alone and among concurrent requests (the quantized GEMM is batch-invariant);
a Hugging Face checkpoint serves quantized too."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from bench.serverproc import ROOT, ServerProcess
from tests.model.qwen_fixtures import make_checkpoint

pytestmark = pytest.mark.integration

PROMPT = "ROMEO.\nWhat light"


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, ServerProcess]]:
    with ServerProcess(ROOT / "weights" / "linear",
                       args=["--quantization", request.param, "--dtype", "float32"]) as srv:
        yield request.param, srv


def test_health_and_models_report_the_quantization(quantized_server: tuple[str, ServerProcess]
                                                   ) -> None:
    mode, srv = quantized_server
    health = httpx.get(srv.url + "/health").json()
    assert health["quantization"] == mode
    full = (ROOT / "weights" / "linear" / "model.safetensors").stat().st_size
    assert 0 < health["weight_bytes"] < 2 * full
    listed = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert listed["quantization"] == mode and listed["weight_bytes"] == health["weight_bytes"]


def test_openai_sdk_completion_and_seeded_reproducibility(
        quantized_server: tuple[str, ServerProcess]) -> None:
    """A seeded sample alone equals the same request among 12 concurrent others."""
    from openai import OpenAI

    _, srv = quantized_server
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    alone = client.completions.create(model="linear", prompt=PROMPT, max_tokens=24,
                                      temperature=0.9, seed=11)
    assert alone.choices[0].text and alone.usage.completion_tokens == 24

    async def crowd() -> list[str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            bodies = [{"prompt": PROMPT + " " * (i % 3), "max_tokens": 24 + i,
                       "temperature": 0.9, "seed": 100 + i} for i in range(12)]
            bodies.insert(5, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.9,
                              "seed": 11})
            replies = await asyncio.gather(*(http.post("/v1/completions", json=b)
                                             for b in bodies))
            return [r.json()["choices"][0]["text"] for r in replies]

    assert asyncio.run(crowd())[5] == alone.choices[0].text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return make_checkpoint(tmp_path_factory.mktemp("qwen-q"), "i4-tied", scale=2.0)


def test_hf_checkpoint_serves_int4(checkpoint: Path) -> None:
    """The Qwen3.5 test checkpoint with --quantization int4: chat and completions through the
    SDK, greedy output equal to the same model quantized in this process."""
    from openai import OpenAI

    from linserve.model import loader

    with ServerProcess.serving(checkpoint, "--quantization", "int4",
                               "--served-model-name", "q") as srv:
        health = httpx.get(srv.url + "/health").json()
        assert health["quantization"] == "int4"
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        chat = client.chat.completions.create(
            model="q", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert chat.choices[0].message.content is not None
        got = client.completions.create(model="q", prompt="To be, or not", max_tokens=16,
                                        temperature=0).choices[0].text
    model = loader.load(checkpoint, "float32", quantization="int4")
    tok = model.tokenizer()
    logits, state = model.prefill(torch.tensor([tok.encode("To be, or not")]))
    ids: list[int] = []
    for _ in range(16):
        ids.append(int(logits.argmax(-1)))
        logits = model.step(torch.tensor(ids[-1:]), state)
    assert got == tok.decode(ids) or tok.decode(ids).startswith(got)  # an eos stops the server
