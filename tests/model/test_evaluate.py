"""The evaluation's measures on tiny random models: the context-use ratio compares the same
positions carried and reset, and the softmax baseline is scored up to its last position."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from linserve.model.training.evaluate import context_use, split_streams, stream_nll, windowed_nll
from tests.model.helpers import tiny_model


@pytest.mark.parametrize("kind", ["linear", "gated", "softmax", "window"])
def test_context_use_compares_the_same_positions(kind: str) -> None:
    model = tiny_model(kind, max_context=512)
    gen = np.random.default_rng(0)
    tokens = gen.integers(0, 97, 4 * 129).astype(np.int64)
    streams = split_streams(tokens, 128, 8)
    assert len(streams) == 4 and all(len(s) == 129 for s in streams)
    cu = context_use(model, streams, 32)
    carried = np.concatenate([stream_nll(model, s)[32:128] for s in streams])
    reset = []
    for s in streams:  # windows 2..4 of 32 tokens, each from an empty state
        nll, count = windowed_nll(model, s, 32)
        first, _ = windowed_nll(model, s[:33], 32)
        reset.append((nll - first) / (count - 32))
    assert cu["ppl_carried"] == pytest.approx(math.exp(carried.mean()), rel=1e-3)
    assert cu["ppl_reset"] == pytest.approx(math.exp(float(np.mean(reset))), rel=1e-3)
    assert cu["ratio"] == pytest.approx(cu["ppl_carried"] / cu["ppl_reset"], abs=1e-4)


def test_softmax_streams_score_every_position_its_context_holds() -> None:
    """max_context positions of input predict max_context targets (the server takes that)."""
    model = tiny_model("softmax", max_context=64)
    tokens = np.arange(100) % 97
    nll = stream_nll(model, tokens)
    assert len(nll) == 64
    with torch.no_grad():
        logits = model(torch.tensor(tokens[None, :64]))
    want = F.cross_entropy(logits[0], torch.tensor(tokens[1:65]), reduction="none")
    assert np.allclose(nll, want.numpy(), atol=1e-4)


def test_a_softmax_model_scored_as_a_window_sees_only_the_band(tmp_path) -> None:
    """``load_model(window=W)``: the same weights under a band mask, with no context limit;
    within the first W positions it is the full model, past them it differs."""
    from linserve.model.architectures.own_model import load_model

    model = tiny_model("softmax", max_context=64)
    model.save(tmp_path)
    banded = load_model(tmp_path, fused=False, window=16)
    assert banded.cfg.window == 16 and banded.cfg.context_limit is None
    tokens = np.arange(100) % 97
    full, band = stream_nll(model, tokens[:60]), stream_nll(banded, tokens[:60])
    assert np.allclose(full[:16], band[:16], atol=1e-5)
    assert not np.allclose(full[30:], band[30:], atol=1e-3)
    assert len(stream_nll(banded, tokens)) == 99  # past the full model's max_context
