"""The native temperature / min-p sampler draws from the same distribution as the eager one."""

from __future__ import annotations

import os

import pytest
import torch

from linserve.model import kernels
from linserve.model.sampling import BatchParams, SamplingParams, TokenMask, make_generator, sample

if not kernels.load():
    if os.environ.get("CI"):
        raise RuntimeError(f"the native kernels did not build: {kernels.load_error()}")
    pytest.skip(f"no C++ toolchain: {kernels.load_error()}", allow_module_level=True)


def draw(logits: torch.Tensor, params: SamplingParams, native: bool, seed: int = 0
         ) -> torch.Tensor:
    """One token for each row of ``logits`` (rows share ``params``, seeds seed + row)."""
    rows = logits.shape[0]
    gens = [make_generator(seed + i) for i in range(rows)]
    return sample(logits, BatchParams.from_params([params] * rows), gens, native=native)


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(9, 300)
    logits[3, 17] = 50.0
    got = draw(logits, SamplingParams(temperature=0.0), native=True)
    assert torch.equal(got, logits.argmax(-1))


def test_frequencies_match_the_tempered_softmax() -> None:
    base = torch.randn(12) * 2
    got = draw(base.repeat(20000, 1), SamplingParams(temperature=0.7), native=True)
    freq = torch.bincount(got, minlength=12).float() / 20000
    want = torch.softmax(base / 0.7, -1)
    assert (freq - want).abs().max().item() < 0.015


def test_min_p_cuts_and_renormalises() -> None:
    base = torch.tensor([4.0, 3.5, 2.0, 1.0, 0.0, -1.0])
    got = draw(base.repeat(20000, 1), SamplingParams(temperature=1.0, min_p=0.2), native=True)
    p = torch.softmax(base, -1)
    keep = p >= 0.2 * p.max()
    assert set(got.unique().tolist()) <= set(keep.nonzero().flatten().tolist())
    want = torch.where(keep, p, torch.zeros_like(p))
    want = want / want.sum()
    freq = torch.bincount(got, minlength=6).float() / 20000
    assert (freq - want).abs().max().item() < 0.015


def test_native_and_eager_agree_draw_for_draw() -> None:
    """Same uniform per row, same distribution: the same token except at rounding ties."""
    logits = torch.randn(2000, 500) * 2
    params = SamplingParams(temperature=0.9, min_p=0.01)
    a = draw(logits, params, native=True, seed=5)
    b = draw(logits, params, native=False, seed=5)
    assert (a == b).float().mean().item() > 0.99


def test_seeded_native_draws_reproduce() -> None:
    logits = torch.randn(6, 400)
    params = SamplingParams(temperature=1.2)
    assert torch.equal(draw(logits, params, True, seed=3), draw(logits, params, True, seed=3))
    assert not torch.equal(draw(logits, params, True, seed=3), draw(logits, params, True, seed=4))


def test_non_finite_logits_never_crash() -> None:
    logits = torch.full((3, 50), float("-inf"))
    logits[1, 7] = 1.0
    logits[2] = float("nan")
    got = draw(logits, SamplingParams(temperature=1.0), native=True)
    assert got[1] == 7 and bool(((got >= 0) & (got < 50)).all())


@pytest.mark.parametrize("constrained", [False, True])
def test_a_seeded_row_draws_the_same_beside_top_p_and_top_k_rows(constrained: bool) -> None:
    """A temperature-only row takes the native path and a top-p / top-k row the sorting one,
    each chosen per row: a seeded row's tokens do not change when its batch mates use top-p
    or top-k (the two paths sum the CDF in different orders, so a batch-wide choice of path
    made a seeded row's text depend on its neighbours)."""
    torch.manual_seed(3)
    vocab, steps = 8192, 1500  # the two paths disagree on ~0.5% of such draws
    logits = torch.randn(steps, 4, vocab) * 2
    seeded = SamplingParams(temperature=1.0, seed=7)
    mates = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=0.9,
                                                                          top_k=40),
             SamplingParams(temperature=0.8, min_p=0.05)]
    bits = torch.full((4, (vocab + 31) // 32), -1, dtype=torch.int32)
    bits[0, ::2] = 0  # row 0 constrained to half the vocabulary
    mask = TokenMask(bits, torch.tensor([0])) if constrained else None
    alone_mask = TokenMask(bits[:1], torch.tensor([0])) if constrained else None
    g_alone, g_mixed = make_generator(7), make_generator(7)
    for t in range(steps):
        alone = sample(logits[t, :1], BatchParams.from_params([seeded]), [g_alone],
                       mask=alone_mask)
        mixed = sample(logits[t], BatchParams.from_params([seeded, *mates]),
                       [g_mixed, None, None, None], mask=mask)
        assert int(alone[0]) == int(mixed[0]), t
