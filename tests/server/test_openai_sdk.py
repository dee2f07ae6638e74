"""The official openai SDK against the real server: sync and async, streaming and not."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_models_list(server: ServerProcess) -> None:
    models = client(server).models.list()
    assert len(models.data) == 1 and models.data[0].id


def test_completion_sync(server: ServerProcess) -> None:
    c = client(server)
    out = c.completions.create(model="x", prompt="To be, or not to be", max_tokens=12,
                               temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 12
    assert out.choices[0].text


def test_completion_stream_with_usage(server: ServerProcess) -> None:
    c = client(server)
    stream = c.completions.create(model="x", prompt="My lord,", max_tokens=20, temperature=0,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].choices == []
    full = c.completions.create(model="x", prompt="My lord,", max_tokens=20, temperature=0,
                                extra_body={"ignore_eos": True})
    assert full.choices[0].text == text


def test_chat_sync_and_stream(server: ServerProcess) -> None:
    c = client(server)
    msgs = [{"role": "system", "content": "A scene from a play."},
            {"role": "user", "content": "What news, my lord?"}]
    out = c.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("stop", "length")
    stream = c.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0,  # type: ignore[arg-type]
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.strip() == (out.choices[0].message.content or "").strip()
    assert chunks[-1].usage is not None


def test_async_client_concurrent(server: ServerProcess) -> None:
    async def run() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async def one(i: int) -> str:
            stream = await ac.completions.create(model="x", prompt=f"Act {i}.", max_tokens=10,
                                                 temperature=0.8, seed=i, stream=True)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])
        outs = await asyncio.gather(*(one(i) for i in range(4)))
        non_stream = await ac.completions.create(model="x", prompt="Act 0.", max_tokens=10,
                                                 temperature=0.8, seed=0)
        assert non_stream.choices[0].text == outs[0]  # same seed, same text
        await ac.close()
        return outs
    outs = asyncio.run(run())
    assert len(outs) == 4


def test_logprobs(server: ServerProcess) -> None:
    c = client(server)
    out = c.completions.create(model="x", prompt="Good morrow", max_tokens=5, temperature=0,
                               logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 5
    assert lp.top_logprobs is not None and all(len(t) == 3 for t in lp.top_logprobs)
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    echo = c.completions.create(model="x", prompt="Good morrow", max_tokens=2, temperature=0,
                                logprobs=1, echo=True)
    assert echo.choices[0].text.startswith("Good morrow")
    assert echo.choices[0].logprobs.token_logprobs[0] is None  # type: ignore[union-attr]


def test_logit_bias_forces_and_bans_tokens(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    kw = {"model": "linear", "prompt": "ROMEO.\n", "max_tokens": 6, "temperature": 0,
          "extra_body": {"ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}}
    plain = client.completions.create(**kw)  # type: ignore[call-overload]
    ids = [int(t.split(":")[1]) for t in plain.choices[0].logprobs.tokens]
    banned = client.completions.create(logit_bias={str(i): -100 for i in set(ids)}, **kw)  # type: ignore[call-overload]
    got = [int(t.split(":")[1]) for t in banned.choices[0].logprobs.tokens]
    assert not set(got) & set(ids)
    forced = client.completions.create(logit_bias={"258": 100}, **kw)  # type: ignore[call-overload]
    assert [int(t.split(":")[1]) for t in forced.choices[0].logprobs.tokens] == [258] * 6
    chat = client.chat.completions.create(model="linear", max_tokens=3, logit_bias={"258": 100},
                                          messages=[{"role": "user", "content": "Hail"}],
                                          extra_body={"ignore_eos": True})
    text = httpx.post(server.url + "/detokenize", json={"tokens": [258] * 3}).json()["prompt"]
    assert chat.choices[0].message.content == text.strip()
