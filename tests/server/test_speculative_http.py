"""Speculative decoding through the real server: ``--speculative-config`` with a draft
checkpoint (``weights/linear-ungated`` drafting for ``weights/linear``), the official SDK,
``/health``, the metrics, and bad configs refused at start-up in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from bench.serverproc import ROOT, ServerProcess

pytestmark = pytest.mark.integration

DRAFT = {"method": "draft_model", "model": str(ROOT / "weights" / "linear-ungated"),
         "num_speculative_tokens": 3, "adaptive": False}
FLAGS: list[str] = []


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    weights = ROOT / "weights" / "linear"
    with ServerProcess(weights, args=[*FLAGS, "--speculative-config", json.dumps(DRAFT)]) as a, \
            ServerProcess(weights, args=FLAGS) as b:
        yield a, b


def sdk(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_the_same_text_with_and_without_speculation(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    fast, plain = servers
    for prompt, extra in (("ROMEO. But soft, what light", {}),
                          ("KING. Now is the winter", {"seed": 7, "temperature": 0.8})):
        kw = {"model": "x", "prompt": prompt, "max_tokens": 40, "temperature": 0.0,
              "extra_body": {"ignore_eos": True}, **extra}
        want = sdk(plain).completions.create(**kw).choices[0].text  # type: ignore[call-overload]
        got = sdk(fast).completions.create(**kw).choices[0].text  # type: ignore[call-overload]
        assert got == want
        stream = sdk(fast).completions.create(**kw, stream=True)  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in stream if c.choices) == want


def test_health_and_metrics_say_what_is_on(servers: tuple[ServerProcess, ServerProcess]) -> None:
    fast, plain = servers
    health = httpx.get(fast.url + "/health").json()
    assert health["speculative"].startswith("draft_model")
    assert httpx.get(plain.url + "/health").json()["speculative"] is None
    sdk(fast).completions.create(model="x", prompt="HAMLET.", max_tokens=16, temperature=0)
    text = httpx.get(fast.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("linserve_spec_decode_")}
    assert values["linserve_spec_decode_draft_tokens_total"] > 0
    assert 0 < values["linserve_spec_decode_accepted_tokens_total"] <= \
        values["linserve_spec_decode_draft_tokens_total"]
    assert values['linserve_spec_decode_accepted_tokens_per_pos_total{position="0"}'] > 0


@pytest.mark.parametrize("config,words", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/x"}',
     "cannot load"),
])
def test_a_bad_config_is_one_line_at_startup(config: str, words: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "linserve", "serve", "--port", "1",
                           "--speculative-config", config], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr
