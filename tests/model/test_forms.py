"""The three forms (forward, prefill, step) agree on the same weights, for every kind:
linear and FAVOR+ (gated or not), full softmax and sliding-window softmax."""

from __future__ import annotations

import pytest
import torch

from linserve.model.layers.ops.gated import gated_linear_naive, gated_linear_parallel
from linserve.model.layers.ops.linear import causal_linear_naive, causal_linear_parallel
from linserve.model.state import KVEntry, State
from tests.model.helpers import tiny_config, tiny_model

RECURRENT = ["linear", "favor", "gated", "gated-favor"]
ALL = [*RECURRENT, "softmax", "window"]


def step_all(model, tokens: torch.Tensor) -> torch.Tensor:
    state = model.new_state(tokens.shape[0])
    return torch.stack([model.step(tokens[:, t], state) for t in range(tokens.shape[1])], 1)


@pytest.mark.parametrize("kind", ALL)
def test_parallel_equals_recurrent_steps(kind: str) -> None:
    model = tiny_model(kind)
    tokens = torch.randint(0, 97, (2, 300))  # crosses many chunk boundaries (chunk 16)
    with torch.no_grad():
        full = model(tokens)
    stepped = step_all(model, tokens)
    assert (full - stepped).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ALL)
def test_prefill_then_steps_equals_forward(kind: str) -> None:
    model = tiny_model(kind)
    tokens = torch.randint(0, 97, (1, 120))
    with torch.no_grad():
        full = model(tokens)
    logits, state = model.prefill(tokens[:, :77])
    assert (logits - full[:, 76]).abs().max() <= 1e-4
    for t in range(77, 120):
        out = model.step(tokens[:, t], state)
        assert (out - full[:, t]).abs().max() <= 1e-4


@pytest.mark.parametrize("kind", ALL)
def test_prefill_in_pieces_equals_one_piece(kind: str) -> None:
    model = tiny_model(kind)
    tokens = torch.randint(0, 97, (1, 150))
    one, st_one = model.prefill(tokens, all_logits=True)
    state = None
    pieces = []
    for lo, hi in [(0, 5), (5, 50), (50, 51), (51, 150)]:
        logits, state = model.prefill(tokens[:, lo:hi], state, all_logits=True)
        pieces.append(logits)
    assert (torch.cat(pieces, 1) - one).abs().max() <= 1e-4
    for name, t in st_one.tensors().items():
        other = state.tensors()[name]  # type: ignore[union-attr]
        n = min(t.shape[3], other.shape[3]) if name in ("k", "v") else None
        if n is None:
            assert torch.allclose(t.float(), other.float(), atol=1e-4)
        else:
            assert torch.allclose(t[:, :, :, :n], other[:, :, :, :n], atol=1e-4)


def test_prefill_does_not_modify_input_state() -> None:
    model = tiny_model("linear")
    _, state = model.prefill(torch.randint(0, 97, (1, 10)))
    before = state.copy()
    model.prefill(torch.randint(0, 97, (1, 10)), state)
    assert all(torch.equal(t, state.tensors()[k]) for k, t in before.tensors().items())


def quadratic_oracle(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
                     z: torch.Tensor, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear attention written the quadratic way, in float64, sharing no code with the
    model: out_t = (φq_t·s0 + Σ_{j≤t} (φq_t·φk_j) v_j) / (φq_t·z0 + Σ_{j≤t} φq_t·φk_j + eps),
    from the T×T score matrix with a causal mask."""
    fq, fk, v, s, z = (x.double() for x in (fq, fk, v, s, z))
    t = fq.shape[2]
    scores = torch.einsum("bhif,bhjf->bhij", fq, fk) * torch.ones(t, t).tril().double()
    num = torch.einsum("bhij,bhjm->bhim", scores, v) + torch.einsum("bhif,bhfm->bhim", fq, s)
    den = scores.sum(-1) + torch.einsum("bhif,bhf->bhi", fq, z)
    s_end = s + torch.einsum("bhjf,bhjm->bhfm", fk, v)
    return num / (den.unsqueeze(-1) + eps), s_end, z + fk.sum(2)


def test_parallel_and_recurrent_forms_match_a_quadratic_oracle() -> None:
    torch.manual_seed(1)
    b, h, t, f, m = 2, 3, 45, 8, 5
    fq, fk = torch.rand(b, h, t, f), torch.rand(b, h, t, f)
    v = torch.randn(b, h, t, m)
    s, z = torch.rand(b, h, f, m), torch.rand(b, h, f)
    want, s_want, z_want = quadratic_oracle(fq, fk, v, s, z)
    for out, s_out, z_out in (causal_linear_parallel(fq, fk, v, s, z, chunk_size=8),
                              causal_linear_naive(fq, fk, v, s, z)):
        assert torch.allclose(out.double(), want, atol=1e-5)
        assert torch.allclose(s_out.double(), s_want, atol=1e-4)
        assert torch.allclose(z_out.double(), z_want, atol=1e-4)


def gated_oracle(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, lg: torch.Tensor,
                 s: torch.Tensor, z: torch.Tensor, eps: float = 1e-6
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated linear attention the quadratic way, in float64, sharing no code with the model:
    key j reaches query t ≥ j decayed by Π_{j<i≤t} g_i per feature, the start state by
    Π_{i≤t} g_i."""
    fq, fk, v, lg, s, z = (x.double() for x in (fq, fk, v, lg, s, z))
    t = fq.shape[2]
    cum = lg.cumsum(2)  # [B, H, T, F]: log Π_{i≤t} g_i
    decay = (cum[:, :, :, None, :] - cum[:, :, None, :, :]).exp()  # [B, H, Tq, Tk, F]
    causal = torch.ones(t, t).tril().double()[None, None, :, :, None]
    scores = torch.einsum("bhif,bhijf,bhjf->bhij", fq, decay * causal, fk)
    q0 = fq * cum.exp()
    num = torch.einsum("bhij,bhjm->bhim", scores, v) + torch.einsum("bhif,bhfm->bhim", q0, s)
    den = scores.sum(-1) + torch.einsum("bhif,bhf->bhi", q0, z)
    to_end = (cum[:, :, -1:] - cum).exp()  # [B, H, T, F]
    s_end = cum[:, :, -1].exp().unsqueeze(-1) * s + torch.einsum("bhjf,bhjm->bhfm", fk * to_end, v)
    z_end = cum[:, :, -1].exp() * z + (fk * to_end).sum(2)
    return num / (den.unsqueeze(-1) + eps), s_end, z_end


def test_gated_forms_match_a_quadratic_oracle() -> None:
    """Chunked (padding and several chunks) and recurrent gated forms = the float64 oracle,
    with gates down to the clamp e^-1, where the in-chunk decay spans e^-C."""
    torch.manual_seed(2)
    b, h, t, f, m = 2, 3, 45, 8, 5
    fq, fk = torch.rand(b, h, t, f), torch.rand(b, h, t, f)
    v = torch.randn(b, h, t, m)
    lg = -torch.rand(b, h, t, f)  # log-gates in [-1, 0]
    s, z = torch.rand(b, h, f, m), torch.rand(b, h, f)
    want, s_want, z_want = gated_oracle(fq, fk, v, lg, s, z)
    for chunk in (8, 16, 64):
        for out, s_out, z_out in (gated_linear_parallel(fq, fk, v, lg, s, z, chunk_size=chunk),
                                  gated_linear_naive(fq, fk, v, lg, s, z)):
            assert torch.allclose(out.double(), want, atol=1e-5)
            assert torch.allclose(s_out.double(), s_want, atol=1e-4)
            assert torch.allclose(z_out.double(), z_want, atol=1e-4)


ABLATIONS = [("gated", {"qk_norm": True}), ("gated", {"output_norm": True}),
             ("linear", {"head_decay": True}),
             ("linear", {"head_decay": True, "output_norm": True})]


@pytest.mark.parametrize(("kind", "flags"), ABLATIONS)
def test_ablations_keep_the_forms_equal_in_the_eager_step(kind: str, flags: dict) -> None:
    model = tiny_model(kind, **flags)
    tokens = torch.randint(0, 97, (2, 70))
    with torch.no_grad():
        full = model(tokens)
        logits, _ = model.prefill(tokens[:, :41])
    assert (full - step_all(model, tokens)).abs().max() <= 1e-4
    assert (logits - full[:, 40]).abs().max() <= 1e-4
    assert model.set_fused_step(True) is False  # the fused step does not carry them


def test_head_decay_is_one_learned_decay_per_head() -> None:
    model = tiny_model("linear", head_decay=True)
    attn = model.layers[0].attn
    lg = attn._log_gate(torch.randn(3, 5, model.cfg.d_model))
    assert lg.shape == (3, 5, model.cfg.n_heads, model.cfg.feature_dim)
    assert torch.equal(lg[0, 0], lg[2, 4])  # data-independent
    assert (lg[0, 0, 0] != lg[0, 0, -1]).all()  # heads start with different memories
    assert model.cfg.kind == "decay-linear"


def test_ablation_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="output_norm needs a decay"):
        tiny_config("linear", output_norm=True)
    with pytest.raises(ValueError, match="head_decay replaces the gate"):
        tiny_config("gated", head_decay=True)


def test_gated_backward_stays_finite_with_gates_at_the_clamp() -> None:
    """Training's backward divides by the in-chunk decay twice: with every gate at e^-1 a
    64-token chunk's e^128 overflowed fp32 and the loss went NaN (the ablation runs did). With
    grad enabled the chunks are at most 16 tokens, and the result is the same."""
    torch.manual_seed(0)
    fq, fk = torch.rand(1, 2, 128, 8) + 0.5, torch.rand(1, 2, 128, 8) + 0.5
    v = torch.randn(1, 2, 128, 8)
    lg = torch.full((1, 2, 128, 8), -1.0, requires_grad=True)
    s, z = torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8)
    out, _, _ = gated_linear_parallel(fq, fk, v, lg, s, z, chunk_size=64)
    out.square().sum().backward()
    assert lg.grad is not None and torch.isfinite(lg.grad).all()
    with torch.no_grad():  # inference keeps 64-token chunks: the same outputs
        ref, _, _ = gated_linear_parallel(fq, fk, v, lg, s, z, chunk_size=64)
    assert torch.allclose(out.detach(), ref, atol=1e-5)


def test_a_gate_of_one_is_ungated_linear_attention() -> None:
    torch.manual_seed(3)
    fq, fk, v = torch.rand(1, 2, 33, 4), torch.rand(1, 2, 33, 4), torch.randn(1, 2, 33, 4)
    s, z = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4)
    gated = gated_linear_parallel(fq, fk, v, torch.zeros_like(fq), s, z, chunk_size=8)
    plain = causal_linear_parallel(fq, fk, v, s, z, chunk_size=8)
    for a, b in zip(gated, plain, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("kind", ALL)
def test_causality(kind: str) -> None:
    model = tiny_model(kind)
    tokens = torch.randint(0, 97, (1, 80))
    changed = tokens.clone()
    t = 50
    changed[0, t] = (changed[0, t] + 1) % 97
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t], b[:, t])
    sa, sb = step_all(model, tokens), step_all(model, changed)
    assert torch.equal(sa[:, :t], sb[:, :t])
    pa, _ = model.prefill(tokens[:, : t + 1], all_logits=True)
    pb, _ = model.prefill(changed[:, : t + 1], all_logits=True)
    assert torch.equal(pa[:, :t], pb[:, :t])


@pytest.mark.parametrize("kind", ALL)
def test_batched_step_with_different_positions_equals_alone(kind: str) -> None:
    model = tiny_model(kind)
    lengths = [3, 40, 17]
    prompts = [torch.randint(0, 97, (1, n)) for n in lengths]
    states = [model.prefill(p)[1] for p in prompts]
    batched = State.cat([s.copy() for s in states])
    nxt = torch.randint(0, 97, (3, 6))
    for t in range(6):
        together = model.step(nxt[:, t], batched)
        for i, st in enumerate(states):
            alone = model.step(nxt[i : i + 1, t], st)
            assert (together[i] - alone[0]).abs().max() <= 1e-5


def held_bytes(state: State) -> int:
    """Bytes the state's tensors really hold (their storages), not a size from shapes."""
    return sum(t.untyped_storage().nbytes() for t in state.tensors().values())


@pytest.mark.parametrize("kind", RECURRENT)
def test_state_size_is_constant(kind: str) -> None:
    model = tiny_model(kind)
    _, short = model.prefill(torch.randint(0, 97, (1, 10)))
    _, long = model.prefill(torch.randint(0, 97, (1, 10_000)))
    for _ in range(50):
        model.step(torch.randint(0, 97, (1,)), long)
    assert not short.grows
    assert held_bytes(short) == held_bytes(long) == short.nbytes


def test_kv_cache_grows_and_is_written_in_place() -> None:
    model = tiny_model("softmax")
    _, short = model.prefill(torch.randint(0, 97, (1, 10)))
    _, long = model.prefill(torch.randint(0, 97, (1, 300)))
    assert long.grows
    assert held_bytes(long) > held_bytes(short)
    kv = long.layers[0]["kv"]
    assert isinstance(kv, KVEntry)
    ptr = kv.k.data_ptr()
    model.step(torch.tensor([1]), long)  # capacity 512 >= 301: no reallocation
    assert kv.k.data_ptr() == ptr and int(long.lengths[0]) == 301


def test_window_cache_is_a_constant_ring_and_needs_no_context_limit() -> None:
    """A window model runs past max_context (rotary angles computed, not looked up) with a
    cache that stops growing at W slots; beyond W tokens back, nothing is seen."""
    model = tiny_model("window", max_context=64, n_layers=1)
    tokens = torch.randint(0, 97, (1, 200))
    _, state = model.prefill(tokens[:, :150])
    kv = state.layers[0]["kv"]
    assert isinstance(kv, KVEntry) and kv.capacity == 24 and not state.grows
    ptr = kv.k.data_ptr()
    stepped = [model.step(tokens[:, t], state) for t in range(150, 200)]
    assert kv.capacity == 24 and kv.k.data_ptr() == ptr and int(state.lengths[0]) == 200
    # one layer: the last token's logits depend only on the last W = 24 tokens (relative
    # rotary positions make the absolute offset irrelevant)
    alone, _ = model.prefill(tokens[:, 200 - 24 : 200])
    assert (alone[0] - stepped[-1][0]).abs().max() <= 1e-4


def test_softmax_refuses_past_max_context() -> None:
    model = tiny_model("softmax", max_context=64)
    _, state = model.prefill(torch.randint(0, 97, (1, 64)))
    with pytest.raises(ValueError, match="max_context"):
        model.step(torch.tensor([1]), state)


@pytest.mark.parametrize("kind", RECURRENT)
@pytest.mark.parametrize("conv_size", [4, 0, 2])
def test_ragged_prefill_equals_one_by_one(kind: str, conv_size: int) -> None:
    """Right-padded batched prefill (the engine's) = each prompt alone, states included,
    with and without a start state; the input states are left untouched."""
    model = tiny_model(kind, conv_size=conv_size)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (5, 17, 1, 40, 3)]
    _, base = model.prefill(torch.randint(0, 97, (1, 10)))
    before = base.copy()
    starts = [None, base, None, base, None]
    logits, states = model.prefill_ragged(prompts, starts)
    assert all(torch.equal(a, b) for a, b in zip(base.tensors().values(),
                                                  before.tensors().values(), strict=True))
    for i, (p, st) in enumerate(zip(prompts, starts, strict=True)):
        want, want_state = model.prefill(torch.tensor([p]), st)
        assert (logits[i] - want[0]).abs().max() <= 1e-5
        for name, t in want_state.tensors().items():
            got = states[i].tensors()[name]
            assert got.shape == t.shape
            if t.numel():
                assert (got - t).abs().max() <= 1e-5 * max(1.0, t.abs().max().item())
        tok = torch.tensor([7])
        assert (model.step(tok, states[i]) - model.step(tok, want_state)).abs().max() <= 1e-5


def test_ragged_prefill_refuses_softmax_and_empty_prompts() -> None:
    with pytest.raises(ValueError, match="recurrent"):
        tiny_model("softmax").prefill_ragged([[1, 2]], [None])
    with pytest.raises(ValueError, match="at least one token"):
        tiny_model("linear").prefill_ragged([[1], []], [None, None])
