"""The engine process's timing metrics reach the API's ``/metrics``."""

from __future__ import annotations

import httpx
import pytest

from bench.serverproc import ServerProcess
from tests.reliability.helpers import metric

pytestmark = pytest.mark.integration


def test_prefill_and_decode_times_are_exported(server: ServerProcess) -> None:
    names = ("linserve_prefill_seconds_count", "linserve_prefill_seconds_sum",
             "linserve_step_seconds_count", "linserve_prompt_tokens_total")
    before = {n: metric(server.url, n) for n in names}
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "Now is the winter of our discontent made glorious summer",
        "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    after = {n: metric(server.url, n) for n in names}
    # the engine's metric events travel with its next delivery: the reply's last one
    assert after["linserve_prefill_seconds_count"] >= before["linserve_prefill_seconds_count"] + 1
    assert after["linserve_prefill_seconds_sum"] > before["linserve_prefill_seconds_sum"]
    assert after["linserve_step_seconds_count"] >= before["linserve_step_seconds_count"] + 5
    assert after["linserve_prompt_tokens_total"] == \
        before["linserve_prompt_tokens_total"] + prompt_tokens
