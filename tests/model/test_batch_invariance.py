"""Batch invariance (linserve/model/invariant.py, linserve/model/kernels/gemm.h): a row's logits,
bit for bit, do not depend on the rows that share its step or its ragged prefill, nor on where a
long prompt is split at chunk multiples; for every kind of model, dtype and form.

``test_each_instruction_set`` re-runs this module in a subprocess for every instruction set
this CPU can execute, forcing ATen's paths (``ATEN_CPU_CAPABILITY``) and the kernels' own
(``LINSERVE_KERNEL_ARCH``, compiled for that ``-march``): AVX2 machines take other kernels
than AVX-512 ones, and the property must hold on each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linserve.model import invariant, kernels, modes, packing
from linserve.model.kernels import cpu_flags
from tests.model.helpers import AVX512, forced_avx2_runs_new_paths, tiny_model

KINDS = ["linear", "gated", "favor", "softmax", "window"]
DTYPES = [torch.float32, torch.bfloat16]
BATCHES = (1, 7, 64)
ISA_RUN = "LINSERVE_TEST_ISA"  # set in the subprocesses of test_each_instruction_set

pytestmark = pytest.mark.skipif(not kernels.load(), reason="native kernels unavailable")


def _model(kind: str, dtype: torch.dtype, fused: bool) -> torch.nn.Module:
    model = tiny_model(kind, vocab_size=300, d_model=64, n_heads=2, d_ff=160).to(dtype)
    model.set_fused_step(fused)
    return model


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("k", "n"), [(64, 256), (255, 100), (300, 1000), (33, 7), (40, 4500),
                                      (40, 328), (64, 24), (64, 88), (300, 1)])
def test_invariant_mm_rows_do_not_depend_on_the_batch(dtype: torch.dtype, packed: bool,
                                                      k: int, n: int) -> None:
    """Every prefix of a 64-row batch, and every row alone, gives the full batch's rows bit
    for bit, and the product is right (within fp32 / bf16-activation rounding). The widths
    cover every column path: whole tiles, a last part one vector or more wide (N = 24, 88,
    328: it took narrower tiles whose arithmetic changed with the row count) and a few
    columns."""
    torch.manual_seed(0)
    w = torch.randn(k, n).to(dtype)
    wk = packing.pack(w) if packed else w  # 4,500 columns: two panels and a narrow one
    x = torch.randn(64, k)
    full = torch.ops.linserve.invariant_mm(x, wk)
    for b in range(1, 65):
        assert torch.equal(torch.ops.linserve.invariant_mm(x[:b], wk), full[:b])
    for i in (0, 5, 63):
        assert torch.equal(torch.ops.linserve.invariant_mm(x[i : i + 1], wk), full[i : i + 1])
    pairs = wk.dim() == 3 and wk.shape[2] == 2  # bf16 dot products round activations to bf16
    if packed and not pairs:  # the panel layout changes where values are read, not the sums
        assert torch.equal(full, torch.ops.linserve.invariant_mm(x, w))
    ref = (x.bfloat16() if pairs else x).double() @ w.double()
    assert (full.double() - ref).abs().max().item() < 1e-4 * k ** 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("k", [1, 33, 64, 130, 2048])
def test_one_column_has_the_bits_of_a_wider_product(dtype: torch.dtype, packed: bool,
                                                    k: int) -> None:
    """A product with one column (a row sum, or a dot with one vector: the norms' sums
    through ``invariant.sum_last``) takes its own path, rows in vector lanes; each row gets
    the bits it gets as the first column of a wider product, for any row count."""
    torch.manual_seed(1)
    w = torch.randn(k, 2).to(dtype)
    x = torch.randn(45, k)
    one, two = ((packing.pack(v) if packed else v) for v in (w[:, :1].contiguous(), w))
    for rows in (1, 5, 16, 17, 45):
        assert torch.equal(torch.ops.linserve.invariant_mm(x[:rows], one),
                           torch.ops.linserve.invariant_mm(x[:rows], two)[:, :1])


@pytest.mark.skipif(not (kernels.load() and torch.ops.linserve.amx_active()),
                    reason="bf16 GEMMs do not run on AMX tiles on this CPU")
@pytest.mark.parametrize(("k", "n"), [(1024, 3584), (70, 200), (33, 4500)])
def test_amx_tiles_agree_with_the_bf16_dot_products(k: int, n: int) -> None:
    """The AMX path (gemm_amx.h) and the AVX512-BF16 one compute the same product of the
    same bf16-rounded activations, within fp32 rounding: both against float64, and each row
    of a 16-row call equal to itself alone on the tiles (with a K tail of 16 pairs and a
    narrow last panel)."""
    torch.manual_seed(0)
    w = torch.randn(k, n).bfloat16()
    wp = packing.pack(w)
    x = torch.randn(16, k)
    ref = x.bfloat16().double() @ w.double()
    try:
        tiles = torch.ops.linserve.invariant_mm(x, wp)
        alone = torch.cat([torch.ops.linserve.invariant_mm(x[i : i + 1], wp) for i in range(16)])
        torch.ops.linserve.set_amx(False)
        dots = torch.ops.linserve.invariant_mm(x, wp)
    finally:
        torch.ops.linserve.set_amx(True)
    assert torch.equal(tiles, alone)
    for y in (tiles, dots):
        assert (y.double() - ref).abs().max().item() < 1e-5 * k ** 0.5


def _quantized(mode: str, w: torch.Tensor) -> torch.Tensor:
    """w [K, N] packed as the engine packs it with ``--quantization mode``."""
    modes.set_quantization(mode)
    try:
        return packing.pack(w)
    finally:
        modes.set_quantization("none")


@pytest.mark.skipif(not (kernels.load() and torch.ops.linserve.amx_active()),
                    reason="quantized GEMMs do not run on AMX tiles on this CPU")
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize(("k", "n"), [(1024, 3584), (96, 200), (64, 24)])
def test_quantized_amx_tiles_give_the_dot_products_bits(mode: str, k: int, n: int) -> None:
    """int8 / int4 products of 16 rows or more run on AMX-INT8 tiles (gemm_quant_amx.h), with
    the same exact integer dots and the same float steps as vpdpbusd: the same bits with the
    tiles on and off, for row counts around the 16-row tiles and 128-row blocks, fewer blocks
    of 32 inputs than are unpacked ahead (K = 96, 64) and more (K = 1,024), narrow last
    vectors (N = 200, 24) and a call of fewer rows than the tiles take."""
    torch.manual_seed(3)
    wk = _quantized(mode, torch.randn(k, n))
    x = torch.randn(300, k) * torch.rand(300, 1) * 4
    try:
        tiles = {b: torch.ops.linserve.invariant_mm(x[:b], wk) for b in (16, 17, 32, 45, 300)}
        torch.ops.linserve.set_amx(False)
        dots = torch.ops.linserve.invariant_mm(x, wk)
    finally:
        torch.ops.linserve.set_amx(True)
    for b, y in tiles.items():
        assert torch.equal(y, dots[:b]), b
    assert torch.equal(torch.ops.linserve.invariant_mm(x[290:], wk), dots[290:])


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize(("k", "n"), [(64, 200), (64, 328), (96, 24), (64, 256)])
def test_quantized_invariant_mm_rows_do_not_depend_on_the_batch(mode: str, k: int, n: int
                                                                ) -> None:
    """int8 / int4 weights: every row alone, or in any group, gives the full batch's bits,
    for widths whose last part is one vector or more (N = 200, 328, 24) or none."""
    torch.manual_seed(1)
    wk = _quantized(mode, torch.randn(k, n))
    x = torch.randn(12, k) * 3
    full = torch.ops.linserve.invariant_mm(x, wk)
    for b in range(1, 13):
        assert torch.equal(torch.ops.linserve.invariant_mm(x[:b], wk), full[:b])
    for i in (0, 7, 11):
        assert torch.equal(torch.ops.linserve.invariant_mm(x[i : i + 1], wk), full[i : i + 1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [True, False])
def test_step_logits_do_not_depend_on_the_batch(kind: str, dtype: torch.dtype,
                                                fused: bool) -> None:
    """Row i's step logits are the same alone, in a batch of 7 and in a batch of 64, with
    rows of different histories beside it."""
    model = _model(kind, dtype, fused)
    if fused and not model.uses_fused_step:
        pytest.skip("no fused step for this kind")
    torch.manual_seed(1)
    tokens = torch.randint(0, 300, (64, 12))
    _, state = model.prefill(tokens, None)
    step = model.step(tokens[:, -1], state.copy())
    for b in BATCHES:
        rows = torch.arange(b) * (64 // b)  # spread the chosen rows over the batch
        _, sub = model.prefill(tokens[rows], None)
        assert torch.equal(model.step(tokens[rows, -1], sub), step[rows]), (kind, b)


@pytest.mark.parametrize("kind", ["linear", "gated", "favor"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_does_not_depend_on_the_batch_or_chunk_splits(kind: str,
                                                              dtype: torch.dtype) -> None:
    """A prompt prefilled alone, in a ragged batch of other lengths, and split at a multiple
    of the chunk size gives the same last logits and the same state, bit for bit."""
    model = _model(kind, dtype, True)
    torch.manual_seed(2)
    prompt = torch.randint(0, 300, (150,)).tolist()
    alone, state = model.prefill(torch.tensor([prompt]))
    ragged, states = model.prefill_ragged([prompt[:37], prompt, prompt[:5], prompt[:100]],
                                          [None] * 4)
    chunk = model.cfg.chunk_size
    first, head = model.prefill(torch.tensor([prompt[: 4 * chunk]]))
    split, tail = model.prefill(torch.tensor([prompt[4 * chunk :]]), head)
    del first
    for logits, st in ((ragged[1:2], states[1]), (split, tail)):
        assert torch.equal(logits, alone)
        mine, ref = st.tensors(), state.tensors()
        assert mine.keys() == ref.keys()
        assert all(torch.equal(mine[k], ref[k]) for k in ref)


@pytest.mark.parametrize(("heads", "groups", "dim"), [(8, 2, 64), (6, 2, 32), (6, 6, 16),
                                                     (6, 1, 48), (4, 2, 24)])
@pytest.mark.parametrize("before", [9, 150])
def test_causal_attention_rows_do_not_depend_on_the_call(heads: int, groups: int,
                                                         dim: int, before: int) -> None:
    """``invariant.attention`` (natively ``attend_causal``): each query row of a prompt
    gives the same bits in one call of 40 rows, in calls split anywhere over the cache, and
    alone (a decode step's call), for 4, 3, 1 and 6 query heads per key-value head and head
    sizes with and without a 16-wide tail (24: one head at a time); and it is causal
    softmax attention (within fp32 rounding of SDPA's, every key count across 16). With 150
    cached positions the rows' blocks (16 rows attended together) cross blocks of 64 keys."""
    with torch.no_grad():  # the native path serves inference only
        _causal_attention_case(heads, groups, dim, before)


def _causal_attention_case(heads: int, groups: int, dim: int, before: int) -> None:
    assert modes.active()
    torch.manual_seed(0)
    t = 40
    q = torch.randn(2, heads, t, dim)
    k, v = torch.randn(2, groups, before + t + 3, dim), torch.randn(2, groups, before + t + 3, dim)
    keys, values = k[:, :, : before + t], v[:, :, : before + t]  # a cache's slice
    whole = invariant.attention(q, keys, values, before)
    mask = torch.ones(t, before + t, dtype=torch.bool).tril(before)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=heads != groups)
    assert (whole - want).abs().max().item() < 1e-5
    for a, b in ((0, 17), (17, 23), (23, 40)):
        part = invariant.attention(q[:, :, a:b], k[:, :, : before + b], v[:, :, : before + b],
                                   before + a)
        assert torch.equal(part, whole[:, :, a:b])
    for i in (0, 1, 7, 15, 16, 31, 39):
        alone = invariant.attention(q[1:, :, i : i + 1], k[1:, :, : before + i + 1],
                                    v[1:, :, : before + i + 1], before + i)
        assert torch.equal(alone, whole[1:, :, i : i + 1])


def test_prefill_split_falls_on_chunk_multiples() -> None:
    """Under the mode, a split point is a multiple of the chunk (0: wait for a fresh budget);
    a whole remainder, or a cap below one chunk, is taken as it is."""
    assert invariant.prefill_split(1000, 512, 512, 64) == 512
    assert invariant.prefill_split(1000, 512, 300, 64) == 256
    assert invariant.prefill_split(1000, 512, 40, 64) == 0
    assert invariant.prefill_split(30, 512, 40, 64) == 30
    assert invariant.prefill_split(100, 16, 512, 64) == 16
    modes.set_enabled(False)
    try:
        assert invariant.prefill_split(1000, 512, 300, 64) == 300
    finally:
        modes.set_enabled(True)


def _instruction_sets() -> list[tuple[str, str]]:
    """(ATEN_CPU_CAPABILITY, -march) pairs this CPU can execute, from the baseline up; and
    where the native build runs bf16 GEMMs on AMX tiles, that build with them turned off
    ("native-no-amx": its AVX512-BF16 dot products, which CPUs without AMX run)."""
    flags = cpu_flags()
    runs = [("default", "x86-64")]
    if forced_avx2_runs_new_paths():
        runs.append(("avx2", "x86-64-v3"))
    if flags >= AVX512:
        runs.append(("avx512", "x86-64-v4"))
    if kernels.load() and torch.ops.linserve.amx_active():
        runs.append(("avx512", "native-no-amx"))
    return runs


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get(ISA_RUN)), reason="already inside one ISA's run")
@pytest.mark.parametrize(("aten", "march"), _instruction_sets())
def test_each_instruction_set(aten: str, march: str) -> None:
    """This module's invariance tests, and the native sampler's (a seeded row's draws beside
    any batch mates), pass with ATen and the kernels forced to each instruction set (the
    native build, AVX512-BF16 included where present, is the main run)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": aten, "LINSERVE_KERNEL_ARCH": march,
           ISA_RUN: march}
    if march == "native-no-amx":
        env.update(LINSERVE_KERNEL_ARCH="native", LINSERVE_AMX="0")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         str(Path(__file__).with_name("test_native_sampling.py")),
         "-k", "not each_instruction_set"],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
