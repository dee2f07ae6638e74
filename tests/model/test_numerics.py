"""FAVOR+ kernel estimation and long-run stability of the recurrent state."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
import torch

from linserve.model.architectures.own_model import load_model
from linserve.model.layers.ops.features import draw_orthogonal_features, favor_raw_features
from tests.model.helpers import tiny_model
from tests.reliability.helpers import FULL

# Steps of the long-recurrence test: 5,000 in CI (each kind's fp32 and fp64 models stepped
# eagerly, about 20 s a kind on two AVX2 cores), 20,000 with LINSERVE_FULL=1.
LONG_STEPS = 20_000 if FULL else 5_000


def test_favor_estimates_softmax_kernel_better_with_more_features() -> None:
    torch.manual_seed(0)
    d = 16
    q, k = torch.randn(64, d) * 0.5, torch.randn(64, d) * 0.5
    exact = torch.exp(q @ k.T / d**0.5)
    errors = []
    for m in (16, 64, 256, 1024):
        trials = []
        for seed in range(5):
            w = draw_orthogonal_features(m, d, seed)
            approx = favor_raw_features(q, w) @ favor_raw_features(k, w).T
            trials.append(((approx - exact).abs() / exact).mean().item())
        errors.append(sum(trials) / len(trials))
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.1


def test_favor_features_survive_save_and_load() -> None:
    model = tiny_model("favor")
    with tempfile.TemporaryDirectory() as tmp:
        model.save(tmp)
        loaded = load_model(Path(tmp))
    for a, b in zip(model.blocks, loaded.blocks, strict=True):
        assert torch.equal(a.attn.favor_w, b.attn.favor_w)
    tokens = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        assert torch.equal(model(tokens), loaded(tokens))
    assert model.fingerprint() == loaded.fingerprint()


@pytest.mark.parametrize("kind", ["linear", "favor", "gated"])
def test_long_recurrence_is_finite_and_matches_float64(kind: str) -> None:
    model = tiny_model(kind)
    ref = tiny_model(kind).double()
    tokens = torch.randint(0, 97, (LONG_STEPS,))
    state, ref_state = model.new_state(1), ref.new_state(1).to(torch.float64)
    worst = 0.0
    for t in range(tokens.shape[0]):
        out = model.step(tokens[t : t + 1], state)
        exp = ref.step(tokens[t : t + 1], ref_state)
        if t % 500 == 0 or t == tokens.shape[0] - 1:
            assert torch.isfinite(out).all()
            rel = ((out.double() - exp).abs().max() / exp.abs().max()).item()
            worst = max(worst, rel)
    assert worst <= 1e-3, worst
    assert all(t.dtype == torch.float32 for t in state.tensors().values() if t.is_floating_point())
