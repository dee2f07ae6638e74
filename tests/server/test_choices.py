"""``n``, batched prompts and ``logit_bias`` over HTTP with the openai SDK: n choices that
differ and repeat under a seed, choice indices i·n + j, interleaved streaming, usage counted
once per prompt."""

from __future__ import annotations

from collections import defaultdict

import pytest
from openai import OpenAI

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none")


def test_n_choices_differ_and_repeat_under_a_seed(server: ServerProcess) -> None:
    kw = {"model": "linear", "prompt": PROMPT, "max_tokens": 12, "n": 4, "seed": 11,
          "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    a = client(server).completions.create(**kw)  # type: ignore[call-overload]
    b = client(server).completions.create(**kw)  # type: ignore[call-overload]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 4
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    # choice j is the request with seed + j
    one = client(server).completions.create(**{**kw, "n": 1, "seed": 13})  # type: ignore[call-overload]
    assert one.choices[0].text == texts[2]
    assert a.usage is not None and a.usage.completion_tokens == 48
    n_prompt = one.usage.prompt_tokens if one.usage else 0
    assert a.usage.prompt_tokens == n_prompt  # the prompt counts once


def test_batched_prompts_follow_openais_indices(server: ServerProcess) -> None:
    prompts = ["HAMLET.\nTo be,", "MACBETH.\nIs this", "LEAR.\nBlow, winds,"]
    r = client(server).completions.create(model="linear", prompt=prompts, max_tokens=8, n=2,
                                          temperature=0, extra_body={"ignore_eos": True})
    got = {c.index: c.text for c in r.choices}
    assert sorted(got) == list(range(6))
    for i, p in enumerate(prompts):
        alone = client(server).completions.create(model="linear", prompt=p, max_tokens=8,
                                                  temperature=0, extra_body={"ignore_eos": True})
        assert got[2 * i] == got[2 * i + 1] == alone.choices[0].text
    ids = [[258, 300, 301], [400, 401]]
    r2 = client(server).completions.create(model="linear", prompt=ids, max_tokens=2,
                                           extra_body={"ignore_eos": True})
    assert r2.usage is not None and r2.usage.prompt_tokens == 5
    assert sorted(c.index for c in r2.choices) == [0, 1]


def test_streaming_interleaves_choices(server: ServerProcess) -> None:
    stream = client(server).chat.completions.create(
        model="linear", messages=[{"role": "user", "content": "Speak."}], max_tokens=16, n=3,
        temperature=1.0, seed=5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "stop": ["zzzz"]})
    parts: dict[int, str] = defaultdict(str)
    finished, order, usage = set(), [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            order.append(ch.index)
            parts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}
    assert len(set(order[:12])) > 1  # chunks of different choices interleave
    whole = client(server).chat.completions.create(
        model="linear", messages=[{"role": "user", "content": "Speak."}], max_tokens=16, n=3,
        temperature=1.0, seed=5, extra_body={"ignore_eos": True, "stop": ["zzzz"]})
    assert [parts[c.index] for c in whole.choices] == [c.message.content for c in whole.choices]
    assert usage is not None and usage.completion_tokens == 48


def test_best_of_returns_the_most_likely_samples(server: ServerProcess) -> None:
    """best_of = 4, n = 2: the two kept samples are the two of highest total log-probability
    among the four that n = 4 gives with the same seed."""
    kw = {"model": "linear", "prompt": PROMPT, "max_tokens": 10, "seed": 21,
          "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    four = client(server).completions.create(n=4, logprobs=0, **kw)  # type: ignore[call-overload]
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client(server).completions.create(n=2, best_of=4, **kw)  # type: ignore[call-overload]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage is not None and best.usage.completion_tokens == 40
    streamed = client(server).completions.create(n=2, best_of=4, stream=True, **kw)  # type: ignore[call-overload]
    assert [c.choices[0].text for c in streamed if c.choices] == [c.text for c in best.choices]
