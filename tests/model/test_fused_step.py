"""The native fused decode steps (linear, gated, softmax and window) compute what the eager
step computes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linserve.model import kernels
from linserve.model.state import KVEntry, State
from tests.model.helpers import tiny_model

if not kernels.load():  # CI has a compiler: there, a kernel that does not build is a failure
    if os.environ.get("CI"):
        raise RuntimeError(f"the fused step kernel did not build: {kernels.load_error()}")
    pytest.skip(f"no C++ toolchain: {kernels.load_error()}", allow_module_level=True)


def pool_view(state: State, n: int) -> State:
    """The first n rows, as the engine's slot pool hands them to ``step``."""
    return state.rows(n)


def run_both(model, state: State, tokens: torch.Tensor, rows: int
             ) -> tuple[float, State, State]:
    """Step ``tokens [T, rows]`` eagerly and fused from copies of ``state``; returns the
    largest logit difference and both final states."""
    eager_st, fused_st = state.copy(), state.copy()
    worst = 0.0
    for t in range(tokens.shape[0]):
        model.set_fused_step(False)
        a = model.step(tokens[t], pool_view(eager_st, rows))
        assert model.set_fused_step(True)
        b = model.step(tokens[t], pool_view(fused_st, rows))
        worst = max(worst, (a - b).abs().max().item())
    model.set_fused_step(False)
    return worst, eager_st, fused_st


@pytest.mark.parametrize(("conv_size", "d_model", "n_heads"),
                         [(4, 32, 2), (0, 32, 2), (1, 32, 2), (2, 32, 2),
                          (4, 128, 2), (4, 256, 4), (3, 48, 2), (4, 64, 2), (2, 128, 4)])
@pytest.mark.parametrize("kind", ["linear", "gated"])
def test_fused_step_equals_eager(kind: str, conv_size: int, d_model: int, n_heads: int) -> None:
    """Ungated and gated; head dims 16, 24, and 32 and 64 (the two specialised paths), every
    conv width, a pool view whose spare row must stay untouched; logits within 1e-5, every
    state tensor within 1e-5 of its own scale (s grows into the thousands here, so absolute
    fp32 rounding does too)."""
    model = tiny_model(kind, conv_size=conv_size, d_model=d_model, n_heads=n_heads)
    _, state = model.prefill(torch.randint(0, 97, (6, 37)))
    worst, eager_st, fused_st = run_both(model, state, torch.randint(0, 97, (40, 5)), rows=5)
    assert worst <= 1e-5
    for name, e in eager_st.tensors().items():
        f = fused_st.tensors()[name]
        if not e.numel():
            continue
        assert (e - f).abs().max() <= 1e-5 * e.abs().max(), name
    for name, t in state.tensors().items():  # row 5 is outside the view
        assert torch.equal(fused_st.tensors()[name][5], t[5]), name


@pytest.mark.parametrize("kind", ["linear", "gated"])
def test_fused_steps_equal_parallel_forward(kind: str) -> None:
    model = tiny_model(kind)
    assert model.set_fused_step(True)
    tokens = torch.randint(0, 97, (3, 300))
    with torch.no_grad():
        full = model(tokens)
    state = model.new_state(3)
    stepped = torch.stack([model.step(tokens[:, t], state) for t in range(300)], 1)
    assert (full - stepped).abs().max().item() <= 1e-4


@pytest.mark.parametrize("batch", [2, 6])  # the bf16 GEMV path and the oneDNN path
@pytest.mark.parametrize("kind", ["linear", "gated"])
def test_fused_bf16_weights_track_fp32(kind: str, batch: int) -> None:
    """bf16 weights with fp32 state: next-token distributions stay close to fp32's (the eager
    bf16 step lands at KL ~1e-5 on this model; the fused one keeps fp32 activations)."""
    model = tiny_model(kind, d_model=64, n_heads=1)
    ref = model.new_state(batch)
    tokens = torch.randint(0, 97, (200, batch))
    want = [torch.log_softmax(model.step(t, ref), -1) for t in tokens]
    model.to(torch.bfloat16)
    assert model.set_fused_step(True)
    state = model.new_state(batch)
    assert all(t.dtype == torch.float32 for t in state.tensors().values() if t.is_floating_point())
    got = [torch.log_softmax(model.step(t, state), -1) for t in tokens]
    kl = max((w.exp() * (w - g)).sum(-1).max().item() for w, g in zip(want, got, strict=True))
    assert kl < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_kernel_matmul_equals_torch(dtype: torch.dtype, rows: int) -> None:
    a, w = torch.randn(rows, 48), torch.randn(48, 200).to(dtype)
    want = a @ w.float()
    got = torch.ops.linserve.matmul(a, w)
    tol = 1e-4 if dtype == torch.float32 or rows <= 4 else 0.3  # large batch: bf16 inputs
    assert (got - want).abs().max().item() <= tol


@pytest.mark.parametrize("kind", ["softmax", "window"])
@pytest.mark.parametrize("d_model", [64, 96])  # head dims 32 (the 16-lane dot) and 48
def test_fused_softmax_step_equals_eager(kind: str, d_model: int) -> None:
    """Rows at different lengths (3, 30 and 50, past the window's 24 slots, so its ring has
    wrapped), stepped 40 times, eager and fused, on a pool view with a spare row that must
    stay untouched; the cache grows (full) or stays W slots (window) the same way."""
    model = tiny_model(kind, d_model=d_model, n_heads=2)
    rows = [model.prefill(torch.randint(0, 97, (1, n)))[1] for n in (3, 30, 50, 7)]
    state = State.cat(rows)
    eager_st, fused_st = state.copy(), state.copy()
    worst = 0.0
    for _ in range(40):
        tok = torch.randint(0, 97, (3,))
        model.set_fused_step(False)
        a = model.step(tok, eager_st.rows(3))
        assert model.set_fused_step(True)
        b = model.step(tok, fused_st.rows(3))
        worst = max(worst, (a - b).abs().max().item())
    assert worst <= 1e-5
    assert torch.equal(eager_st.lengths, fused_st.lengths)
    for mine, theirs in zip(eager_st.entries(), fused_st.entries(), strict=True):
        assert isinstance(mine, KVEntry) and isinstance(theirs, KVEntry)
        assert mine.capacity == theirs.capacity
        assert (mine.k - theirs.k).abs().max() <= 1e-5
        assert (mine.v - theirs.v).abs().max() <= 1e-5
    for name, t in eager_st.tensors().items():  # row 3 is outside the view
        assert torch.equal(fused_st.tensors()[name][3], t[3]), name


@pytest.mark.parametrize("kind", ["softmax", "window"])
def test_fused_softmax_steps_equal_parallel_forward(kind: str) -> None:
    model = tiny_model(kind)
    assert model.set_fused_step(True)
    tokens = torch.randint(0, 97, (2, 120))
    with torch.no_grad():
        full = model(tokens)
    state = model.new_state(2)
    stepped = torch.stack([model.step(tokens[:, t], state) for t in range(120)], 1)
    assert (full - stepped).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["favor", "gated-favor"])
def test_other_kinds_keep_the_eager_step(kind: str) -> None:
    model = tiny_model(kind)
    assert model.set_fused_step(True) is False
    assert not model.uses_fused_step


def test_kernel_rejects_a_mismatched_state() -> None:
    model = tiny_model("linear")
    assert model.set_fused_step(True)
    wrong = tiny_model("linear", n_layers=3).new_state(2)
    with pytest.raises(RuntimeError, match="layers"):
        model.step(torch.zeros(2, dtype=torch.long), wrong)  # type: ignore[arg-type]


def test_without_the_kernel_the_model_falls_back_to_eager(tmp_path) -> None:
    """A library that cannot load (no compiler in a slim image, say) never breaks the model."""
    code = ("from linserve.model import kernels\n"
            "from tests.model.helpers import tiny_model; import torch\n"
            "m = tiny_model('linear'); assert m.set_fused_step(True) is False\n"
            "assert kernels.load_error()\n"
            "print(m.step(torch.zeros(1, dtype=torch.long), m.new_state(1)).shape)")
    env = {**os.environ, "LINSERVE_KERNEL_LIB": str(tmp_path / "missing.so")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=False,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert "torch.Size([1, 97])" in out.stdout


@pytest.mark.parametrize(("k", "c"), [(4, 48), (2, 768), (1, 5)])
def test_native_causal_conv_equals_conv1d(k: int, c: int) -> None:
    """The prefill's native causal convolution = ATen's depthwise conv1d, layouts aside."""
    x = torch.randn(3, 37 + k - 1, c)
    w = torch.randn(c, k)
    want = torch.nn.functional.conv1d(x.transpose(1, 2), w.unsqueeze(1), groups=c)
    got = torch.ops.linserve.causal_conv(x, w.T.contiguous())
    assert torch.allclose(got, want.transpose(1, 2), atol=1e-5)


@pytest.mark.parametrize(("heads", "d"), [(4, 64), (2, 8), (3, 5)])
def test_native_qkv_features_split_heads_and_apply_elu_plus_one(heads: int, d: int) -> None:
    """qkv [B, T, 3·H·D] -> φ(q), φ(k), v as contiguous [B, H, T, D], φ = elu + 1."""
    qkv = torch.cat([torch.randn(2, 33, 3 * heads * d) * 5,
                     torch.full((2, 1, 3 * heads * d), -100.0)], dim=1)
    fq, fk, v = torch.ops.linserve.qkv_features(qkv, heads)
    q, k, vv = qkv.view(2, 34, 3, heads, d).permute(2, 0, 3, 1, 4)
    for got, want in ((fq, torch.nn.functional.elu(q) + 1), (fk, torch.nn.functional.elu(k) + 1)):
        assert got.is_contiguous() and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(v, vv)


def test_native_rms_norm_equals_torch() -> None:
    """The prefill's native RMSNorm = nn.RMSNorm (eps from fp32) on rows of any leading shape."""
    norm = torch.nn.RMSNorm(48)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(3, 29, 48) * 4
    got = torch.ops.linserve.rms_norm_rows(x, norm.weight.detach(),
                                           torch.finfo(torch.float32).eps)
    assert torch.allclose(got, norm(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "gated"])
def test_prefill_is_the_same_with_and_without_the_native_ops(kind: str) -> None:
    """Inference uses the native convolution and feature map, training ATen's: the same
    logits and state."""
    model = tiny_model(kind)
    tokens = torch.randint(0, 97, (2, 90))
    native_logits, native_state = model.prefill(tokens, all_logits=True)
    with torch.enable_grad():
        aten_logits = model(tokens)  # grad enabled: the F.conv1d path
    assert torch.allclose(native_logits, aten_logits.detach(), atol=1e-5)
    assert not native_state.grows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gelu_equals_torch(dtype: torch.dtype) -> None:
    """The native tanh GELU (prefill MLPs and both fused steps) = F.gelu(approximate="tanh")."""
    x = torch.cat([torch.randn(50_000) * 4, torch.tensor([0.0, -0.0, 30.0, -30.0, 1e6, -1e6])])
    x = x.to(dtype)
    want = torch.nn.functional.gelu(x.float(), approximate="tanh")
    got = torch.ops.linserve.gelu_tanh_(x.clone()).float()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got, want.to(dtype).float(), rtol=tol, atol=tol)
