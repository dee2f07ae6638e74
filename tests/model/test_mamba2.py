"""The Mamba2 layer's chunked SSD and native scan (linserve/model/layers/mamba2.py) against the
plain recurrence, with decays fast enough to reach fp32's subnormal range (which the chunked form
flushes to 0, and the scan treats as 0); the prefill's native SwiGLU activation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linserve.model import kernels
from linserve.model.layers.mamba2 import _exp_flushed, ssd_chunked


def _recurrence(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                c: torch.Tensor, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S ← exp(dt a) S + dt x Bᵀ, y = S C, token by token in float64 (B, C ``[T, G, N]``
    shared by each group's heads)."""
    heads, groups = x.shape[1], b.shape[1]
    b, c = (y.double().repeat_interleave(heads // groups, dim=1) for y in (b, c))
    s, ys = s0.double(), []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t].double() * a.double())[:, None, None]
        s = decay * s + (x[t].double() * dt[t].double()[:, None])[..., None] * b[t][:, None]
        ys.append((s * c[t][:, None]).sum(-1))
    return torch.stack(ys), s


@pytest.mark.parametrize(("t", "groups"), [(100, 2), (64, 1), (7, 4)])
def test_chunked_ssd_equals_the_recurrence_with_subnormal_decays(t: int, groups: int) -> None:
    """Prompts that the 64-token chunks divide or not, 1 to 4 groups, heads whose decay over a
    chunk is far below fp32's smallest normal (A down to -40, dt up to ~5): the chunked form
    gives the recurrence's outputs and final state within fp32 rounding."""
    torch.manual_seed(0)
    heads, p, n = 8, 16, 32
    x = torch.randn(t, heads, p)
    dt = F.softplus(torch.randn(t, heads) * 2)
    a = -torch.linspace(0.01, 40.0, heads)
    b, c = torch.randn(t, groups, n), torch.randn(t, groups, n)
    s0 = torch.randn(heads, p, n)
    y, s = ssd_chunked(x, dt, a, b, c, s0)
    y_ref, s_ref = _recurrence(x, dt, a, b, c, s0)
    assert y.shape == (t, heads, p) and s.shape == (heads, p, n)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-4, atol=1e-4)


def test_flushed_exp_is_exp_or_zero_and_never_subnormal() -> None:
    x = torch.linspace(-120.0, 0.0, 10_001)
    y = _exp_flushed(x)
    tiny = torch.finfo(torch.float32).tiny
    assert bool(((y == 0) | (y >= tiny)).all())
    keep = x >= -60.0
    assert torch.equal(y[keep], x[keep].exp()) and bool((y[~keep] == 0).all())


@pytest.mark.skipif(not kernels.load(), reason="native kernels unavailable")
@pytest.mark.parametrize(("t", "groups", "p", "n"),
                         [(100, 2, 16, 32), (7, 4, 8, 20), (65, 1, 64, 128)])
def test_native_scan_equals_the_recurrence_and_the_chunked_form(t: int, groups: int, p: int,
                                                                n: int) -> None:
    """``mamba2_scan_`` over a ragged batch (one row shorter, right-padded): each row's
    outputs and final state are the recurrence's within fp32 rounding, and the chunked
    form's, with decays down to fp32's subnormal range and a d_state that 16 lanes
    do or do not divide; the padding's outputs are zeros and the state stops at the row's
    last token."""
    torch.manual_seed(1)
    heads = 8
    x = torch.randn(2, t, heads, p)
    dt = F.softplus(torch.randn(2, t, heads) * 2)
    a_log = torch.linspace(0.01, 40.0, heads).log()
    b, c = torch.randn(2, t, groups, n), torch.randn(2, t, groups, n)
    s0 = torch.randn(2, heads, p, n)
    counts = torch.tensor([t, max(1, t - 6)])
    s, y = s0.clone(), torch.full((2, t, heads * p), float("nan"))
    torch.ops.linserve.mamba2_scan_(s, y, x.flatten(2), dt, a_log, b.flatten(2), c.flatten(2),
                                    counts)
    y = y.view(2, t, heads, p)
    for i, k in enumerate(counts.tolist()):
        args = (x[i, :k], dt[i, :k], -a_log.exp(), b[i, :k], c[i, :k], s0[i])
        y_ref, s_ref = _recurrence(*args)
        torch.testing.assert_close(y[i, :k].double(), y_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s[i].double(), s_ref, rtol=1e-4, atol=1e-4)
        y_chunked, _ = ssd_chunked(*args)
        torch.testing.assert_close(y[i, :k], y_chunked, rtol=2e-4, atol=2e-4)
        assert bool((y[i, k:] == 0).all())


@pytest.mark.skipif(not kernels.load(), reason="native kernels unavailable")
def test_native_swiglu_rows_is_silu_gate_times_up() -> None:
    """``swiglu_rows`` (the prefill's SwiGLU activation, in fp32 between the GEMMs) against
    ATen's silu(gate) · up, over more rows than one thread's share."""
    gate_up = torch.randn(37, 2 * 48) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.linserve.swiglu_rows(gate_up), F.silu(gate) * up,
                               rtol=1e-6, atol=1e-6)


# float32 bit patterns (see the test below)
EXP_ROUNDING_EDGES = [
    0x3f851592, 0xbf851592, 0xc01b43d5, 0xc073fce1, 0xc0bc893a, 0xc0d2b77c,
    0xc0e8e5c0, 0xc0ff1402, 0xc10aa123, 0xc120cf66, 0xc136fda9, 0xc14214ca,
    0xc14d2bec, 0xc158430d, 0xc1635a2f, 0xc16e7150, 0xc1798872, 0xc18d66eb,
    0xc192f27c, 0xc1a3952e, 0xc1a920bf, 0xc1b437e1, 0xc1b9c371, 0xc1ca6624,
    0xc1cff1b4, 0xc1e09467, 0xc1e61ff7, 0xc1f6c2aa, 0xc1fc4e3a, 0xc2118f98,
    0xc2145560, 0xc227bddb, 0xc22a83a3, 0xc232d4fd, 0xc2359ac4, 0xc23b2655,
    0xc23dec1e, 0xc240b1e6, 0xc24377af, 0xc2490340, 0xc2515498, 0xc2541a61,
    0xc256e029, 0xc259a5f2, 0xc25f3183, 0xc26782db, 0xc26a48a4, 0xc26d0e6c,
    0xc26fd435, 0xc2755fc6, 0xc27db11e, 0xc283013c, 0xc28b5295, 0xc28cb579,
    0xc290de26, 0xc29506d2, 0xc2992f7f, 0xc29a9263, 0xc2a180d8, 0xc2a2e3bc,
    0xc2a70c69, 0xc2ab3515,
]


@pytest.mark.skipif(not kernels.load(), reason="native kernels unavailable")
def test_vector_activations_equal_their_scalar_tail_bit_for_bit() -> None:
    """SiLU and GELU run on the CPU's vectors (8 or 16 lanes) with the row's tail past them
    one value at a time (fastmath.h's ``exp_nonpositive_lanes``): the same value gives the
    same bits in a vector lane (column 0) and in the scalar tail (column 16 of 17), so a
    token's activation does not depend on where it sits in a row. ``EXP_ROUNDING_EDGES``:
    the 62 of all 2^32 inputs where SiLU's exponential differs if v log2(e) is fused into its
    rounding (as ``exp_nonpositive_fused`` does), which random inputs would not find."""
    torch.manual_seed(0)
    values = torch.cat([torch.randn(20_000) * 6, torch.randn(2_000) * 1e-3,
                        torch.tensor([0.0, -0.0, 87.5, -87.5, 200.0, -200.0, 1e-40, -1e-40]),
                        torch.tensor(EXP_ROUNDING_EDGES).to(torch.int32).view(torch.float32)])
    rows = torch.zeros(values.numel(), 17)
    rows[:, 0] = rows[:, 16] = values
    gate_up = torch.cat([rows, torch.ones_like(rows)], dim=1)
    silu = torch.ops.linserve.swiglu_rows(gate_up.contiguous())
    assert torch.equal(silu[:, 0].view(torch.int32), silu[:, 16].view(torch.int32))
    gelu = torch.ops.linserve.gelu_tanh_(rows.clone().contiguous())
    assert torch.equal(gelu[:, 0].view(torch.int32), gelu[:, 16].view(torch.int32))
