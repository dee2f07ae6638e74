"""The stall watchdog watches progress, not iterations: a step several times longer than
``--engine-stall-seconds`` that computes is left alone, while a stopped (SIGSTOP) or
deadlocked engine is noticed within the setting and replaced."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from bench.serverproc import ServerProcess
from tests.model.helpers import TOKENIZER, tiny_model
from tests.reliability.helpers import metric
from tests.reliability.test_faults import engine_pid, wait_status

pytestmark = [pytest.mark.integration]
STALL = 0.5  # seconds; a 2,048-token fp32 prefill step of the model below takes 2-6x this


@pytest.fixture(scope="module")
def slow_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random own model big enough that one 2,048-token prefill chunk takes seconds in
    fp32 on two cores (d_model 1024, 6 layers: 84M parameters)."""
    path = tmp_path_factory.mktemp("slow-model")
    tiny_model("linear", vocab_size=8192, d_model=1024, n_layers=6, n_heads=8, d_ff=4096,
               n_features=128, max_context=8192, chunk_size=64).save(path)
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path


def test_a_long_step_that_computes_is_not_a_stall(slow_weights: Path) -> None:
    """One prefill step of ~2,000 tokens, far longer than the stall setting: nothing
    restarts and the request succeeds."""
    args = ["--dtype", "float32", "--engine-stall-seconds", str(STALL), "--prefill-chunk",
            "2048", "--step-token-budget", "2048", "--prefix-cache-bytes", "0"]
    with ServerProcess(slow_weights, args=args) as srv:
        prompt = "ROMEO. But soft, what light through yonder window breaks? " * 135
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        seconds = time.monotonic() - t0
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] > 1500 and usage["completion_tokens"] == 4
        assert metric(srv.url, "linserve_engine_restarts_total") == 0
        assert "engine failure" not in srv.logs()
    print(f"a {usage['prompt_tokens']}-token prefill step took {seconds:.1f} s "
          f"({seconds / STALL:.0f}x the stall setting): no restart")
    assert seconds > 2 * STALL, "the step must outlast the stall setting for this to test it"


@pytest.mark.parametrize("how", ["sigstop", "deadlock"])
def test_a_hung_engine_is_noticed_and_replaced(linear_weights: Path, how: str) -> None:
    """SIGSTOP of the engine process, or its thread blocked on a lock for good: /health
    turns 503 within the stall setting (plus the supervisor's poll), a fresh engine comes
    up, and it serves."""
    stall = 1.0
    args = ["--engine-stall-seconds", str(stall), "--fault-injection"]
    with ServerProcess(linear_weights, args=args) as srv:
        body = {"prompt": "KING.\n", "max_tokens": 8, "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        old = engine_pid(srv.url)
        t0 = time.monotonic()
        try:
            if how == "sigstop":
                os.kill(old, signal.SIGSTOP)
            else:
                with contextlib.suppress(httpx.TimeoutException):
                    httpx.post(srv.url + "/v1/completions", timeout=0.3,
                               json={**body, "linserve_fault": "deadlock"})
            wait_status(srv.url, 503, stall + 5)
            noticed = time.monotonic() - t0
            wait_status(srv.url, 200, 120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGCONT)
        assert engine_pid(srv.url) != old
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert metric(srv.url, "linserve_engine_restarts_total") == 1
        assert "made no progress" in srv.logs()
    print(f"{how}: /health 503 after {noticed:.2f} s (stall setting {stall} s)")
    assert noticed < stall + 1.5
