"""The Mamba-1 layer's native scan (``mamba1_scan_``, linserve/model/kernels/mamba1.h) against
the plain recurrence in float64 and the layer's ATen form: fast decays, channels that do
not fill a vector, ragged rows, and a row's bits whatever its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linserve.model import kernels
from linserve.model.layers.mamba1 import Mamba1, Mamba1Shape

pytestmark = pytest.mark.skipif(not kernels.load(), reason="native kernels not built")


def _recurrence(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                c: torch.Tensor, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s ← exp(dt a) s + dt x b, y = s · c, per channel, in float64: x, dt ``[T, D]``,
    a ``[D, N]``, b, c ``[T, N]``, s0 ``[D, N]``."""
    s, ys = s0.double(), []
    for t in range(x.shape[0]):
        s = torch.exp(dt[t, :, None].double() * a.double()) * s \
            + (dt[t] * x[t]).double()[:, None] * b[t].double()
        ys.append(s @ c[t].double())
    return torch.stack(ys), s


@pytest.mark.parametrize(("t", "d", "n"), [(50, 40, 16), (1, 16, 8), (9, 7, 24)])
def test_the_native_scan_equals_the_recurrence(t: int, d: int, n: int) -> None:
    """Outputs and final state within fp32 rounding of float64, with decays from slow to
    far below fp32's normal range (A down to -300), and 7 or 40 channels (a vector's tail)."""
    torch.manual_seed(0)
    x, dt = torch.randn(1, t, d), F.softplus(torch.randn(1, t, d) * 2)
    a = -torch.linspace(0.01, 300.0, d * n).reshape(d, n)
    b, c, s0 = torch.randn(1, t, n), torch.randn(1, t, n), torch.randn(1, d, n)
    s = s0.clone()
    y = torch.empty_like(x)
    torch.ops.linserve.mamba1_scan_(s, y, x, dt, a, b, c, torch.tensor([t]))
    want_y, want_s = _recurrence(x[0], dt[0], a, b[0], c[0], s0[0])
    assert (y[0].double() - want_y).abs().max().item() <= 1e-4 * max(1.0, want_y.abs().max())
    assert (s[0].double() - want_s).abs().max().item() <= 1e-4 * max(1.0, want_s.abs().max())


def _layer() -> Mamba1:
    torch.manual_seed(1)
    layer = Mamba1(Mamba1Shape(hidden=24, inner=40, d_state=12, dt_rank=3, conv_width=4,
                               bcdt_eps=1e-6)).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


@torch.inference_mode()
def test_native_and_aten_forms_agree_and_rows_do_not_depend_on_the_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged batch of three rows through the native scan: each row bit for bit as it is
    alone, the padded rows' state untouched past their tokens; and the ATen form within
    fp32 rounding of it."""
    layer = _layer()
    counts = torch.tensor([11, 4, 7])
    x = torch.randn(3, 11, 24)
    entries = layer.new_entries(3, 64)
    out = layer(x, entries, torch.zeros(3), counts)
    for i, n in enumerate(counts.tolist()):
        alone = layer.new_entries(1, 64)
        one = layer(x[i : i + 1, :n], alone, torch.zeros(1))
        assert torch.equal(one[0], out[i, :n])
        assert torch.equal(alone["recurrent"].s[0], entries["recurrent"].s[i])
        assert torch.equal(alone["conv"].window[0], entries["conv"].window[i])
    monkeypatch.setattr(kernels, "available", lambda: False)
    aten_entries = layer.new_entries(3, 64)
    aten = layer(x, aten_entries, torch.zeros(3), counts)
    for i, n in enumerate(counts.tolist()):
        assert (aten[i, :n] - out[i, :n]).abs().max().item() <= 1e-5
    assert (aten_entries["recurrent"].s - entries["recurrent"].s).abs().max().item() <= 1e-5
