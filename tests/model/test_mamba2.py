"""The Mamba2 layer's chunked SSD (model/layers/mamba2.py) against the plain recurrence, with
decays fast enough to reach fp32's subnormal range (which the chunked form flushes to 0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.layers.mamba2 import _exp_flushed, ssd_chunked


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
