"""Sampling masks, penalties and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from linserve.model.sampling import (
    BatchParams,
    SamplingParams,
    apply_penalties,
    make_generator,
    min_p_mask,
    sample,
    top_k_mask,
    top_p_mask,
)


def bp(*params: SamplingParams) -> BatchParams:
    return BatchParams.from_params(params)


def test_seeded_sampling_reproduces_exactly() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.9, seed=s) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        gens = [make_generator(p.seed) for p in params]
        runs.append(torch.stack([sample(logits, bp(*params), gens) for _ in range(20)]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0][:, 0], runs[0][:, 1])  # different seeds differ


def test_row_results_do_not_depend_on_batch_neighbours() -> None:
    logits = torch.randn(2, 50)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    alone = sample(logits[:1], bp(p), [make_generator(7)])
    together = sample(logits, bp(p, SamplingParams(temperature=0.0)),
                      [make_generator(7), make_generator(0)])
    assert alone[0] == together[0]
    assert together[1] == logits[1].argmax()


@pytest.mark.parametrize("native", [True, False])
def test_a_seeded_row_ignores_unseeded_mates_drawing_from_the_shared_generator(
        native: bool) -> None:
    """Unseeded rows (generator None) draw together from one shared generator; a seeded row
    draws from its own, so its tokens are the same beside any number of unseeded rows."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    seeded = SamplingParams(temperature=1.0, seed=11)
    free = SamplingParams(temperature=1.0)
    alone = [sample(logits[:1], bp(seeded), [g], native=native)[0].item()
             for g in [make_generator(11)] for _ in range(30)]
    gen = make_generator(11)
    mixed = [sample(logits, bp(seeded, *[free] * 5), [gen, *[None] * 5], native=native)
             for _ in range(30)]
    assert [int(m[0]) for m in mixed] == alone
    unseeded = torch.stack(mixed)[:, 1:]
    assert len(set(unseeded.flatten().tolist())) > 5  # they do sample, and differ


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 30)
    out = sample(logits, bp(*[SamplingParams(temperature=0.0)] * 4), [make_generator(0)] * 4)
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_mask() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    mask = top_k_mask(logits, torch.tensor([2, 0]))
    assert mask[0].tolist() == [True, False, True, False, True]
    assert not mask[1].any()


def test_top_p_mask_keeps_smallest_covering_set() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert top_p_mask(probs, torch.tensor([0.7])).tolist() == [[False, False, True, True]]
    assert top_p_mask(probs, torch.tensor([0.8])).tolist() == [[False, False, True, True]]
    assert top_p_mask(probs, torch.tensor([0.81])).tolist() == [[False, False, False, True]]
    assert top_p_mask(probs, torch.tensor([0.01])).tolist() == [[False, True, True, True]]
    # a top_p that underflows to 0 in fp32 (a JSON 1e-323) still keeps the top token
    assert top_p_mask(probs, torch.tensor([1e-323])).tolist() == [[False, True, True, True]]


def test_min_p_mask() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert min_p_mask(probs, torch.tensor([0.2])).tolist() == [[False, False, False, True]]
    assert min_p_mask(probs, torch.tensor([0.5])).tolist() == [[False, False, True, True]]


def test_sampling_respects_masks() -> None:
    logits = torch.tensor([[0.0, 10.0, 9.5, -5.0, 9.0]]).repeat(200, 1)
    p = SamplingParams(temperature=1.0, top_k=2)
    out = sample(logits, bp(*[p] * 200), [make_generator(i) for i in range(200)])
    assert set(out.tolist()) <= {1, 2} and len(set(out.tolist())) == 2


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    seen = torch.tensor([[True, True, True, False]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = apply_penalties(logits, counts, seen, bp(p))
    # token 0: 2 - 0.5 - 0.5 = 1.0, then /2; token 1: -2 - 0.25 - 0.5 = -2.75, then *2
    # token 2: seen in prompt only: 1.0 / 2; token 3: untouched
    assert torch.allclose(out, torch.tensor([[0.5, -5.5, 0.5, 0.5]]))
    # a repetition penalty that underflows to 0 in fp32 (a JSON 1e-300) stays finite
    tiny = apply_penalties(logits, counts, seen, bp(SamplingParams(repetition_penalty=1e-300)))
    assert torch.isfinite(tiny).all()


@pytest.mark.parametrize("native", [False, True])
def test_logit_bias_bans_and_forces(native: bool) -> None:
    from linserve.model import kernels
    from linserve.model.sampling import BatchParams, SamplingParams, make_generator, sample

    if native and not kernels.load():
        pytest.skip("native kernels unavailable")
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 2
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0.0, logit_bias=((int(top[0]), -100.0),)),
              SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)),
              SamplingParams(temperature=1.0, logit_bias=((3, 100.0),)),
              SamplingParams(temperature=0.0)]
    bp = BatchParams.from_params(params)
    gens = [make_generator(i) for i in range(4)]
    for _ in range(20):
        tokens = sample(logits, bp, gens, native=native)
        assert int(tokens[0]) != int(top[0])  # banned
        assert int(tokens[1]) == 7 and int(tokens[2]) == 3  # forced, greedy and sampled
        assert int(tokens[3]) == int(top[3])  # an unbiased row is untouched

