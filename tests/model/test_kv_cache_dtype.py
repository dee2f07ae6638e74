"""KV caches held in bf16 or int8 (``--kv-cache-dtype``, :class:`linserve.model.state.KVEntry`):
the int8 rows' layout and rounding, every form over a stored cache agreeing (a prompt whole,
in chunks and step by step; the native step and the eager one; a row alone and in a batch),
blobs in every dtype and across dtypes, the bytes a token costs, and what it does to the
next-token distributions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from linserve.model import kernels, loader, modes
from linserve.model.served import ServedModule
from linserve.model.state import (
    KVEntry,
    State,
    StateError,
    dequantize_rows,
    quantize_rows,
)
from linserve.model.state_blob import state_from_bytes
from tests.model.qwen_fixtures import make_checkpoint

pytest.importorskip("transformers")
DTYPES = ("bf16", "int8")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5 with a 32-wide head (an int8 row: 32 values and one scale)."""
    return make_checkpoint(tmp_path_factory.mktemp("kv"), "i4-tied", tokenizer="project")


@pytest.fixture(autouse=True)
def _fp32_after() -> Iterator[None]:
    yield
    modes.set_kv_cache_dtype("fp32")


def _load(path: Path, kv: str) -> ServedModule:
    model = loader.load(path, "float32", kv_cache_dtype=kv)
    assert isinstance(model, ServedModule)
    return model


def test_int8_rows_hold_values_then_scales_and_round_to_within_half_a_step() -> None:
    """A row of D values is D int8 values then D / 32 fp32 scales (max |x| / 127 per block);
    read back, each value is within half a step of what was written; an all-zero block
    reads back zeros; values at a block's maximum come back exactly."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, 64) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None, None]
    x[0, 0, 0, :32] = 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 2, 5, 72)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    blocks = x.reshape(3, 2, 5, 2, 32)
    assert torch.equal(scale, blocks.abs().amax(-1) / 127)
    back = dequantize_rows(rows)
    step = scale.repeat_interleave(32, -1)
    assert ((back - x).abs() <= step / 2 + 1e-7 * x.abs()).all()
    assert torch.equal(back[0, 0, 0, :32], torch.zeros(32))
    top = blocks.abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.reshape(3, 2, 5, 2, 32).gather(-1, top),
                          blocks.gather(-1, top), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kv", DTYPES)
def test_a_stored_cache_costs_its_bytes(checkpoint: Path, kv: str) -> None:
    """A bf16 cache is half an fp32 one's bytes per token, an int8 one 9/32 (the scales
    included); the model's info says so, and a head size int8 cannot block is held bf16.
    Each model keeps the dtype it was loaded with, whatever is loaded after it."""
    first = _load(checkpoint, "fp32")
    fp32 = first.info.state_bytes_per_token
    per_token = _load(checkpoint, kv).info.state_bytes_per_token
    assert first.new_state().kv_dtype == "fp32"
    assert per_token * (2 if kv == "bf16" else 32) == fp32 * (1 if kv == "bf16" else 9)
    assert KVEntry.empty(1, 2, 48, 100, dtype="int8").dtype == "bf16"


@pytest.mark.parametrize("kv", DTYPES)
def test_a_prompt_whole_in_chunks_and_step_by_step_agree(checkpoint: Path, kv: str) -> None:
    """Over a stored cache every key is read back as stored, whoever wrote it, so a prompt
    prefilled whole and in chunks gives the same bits, and stepping through its end token by
    token (native steps) gives its logits within fp32 rounding."""
    model = _load(checkpoint, kv)
    ids = torch.randint(0, 8192, (1, 40), generator=torch.Generator().manual_seed(3))
    whole, s1 = model.prefill(ids)
    assert next(iter(s1.kv_entries)).dtype == kv
    _, s2 = model.prefill(ids[:, :17])
    tail, s2 = model.prefill(ids[:, 17:], s2)
    assert torch.equal(whole, tail)
    for a, b in zip(s1.tensors().values(), s2.tensors().values(), strict=True):
        assert torch.equal(a, b)
    _, s3 = model.prefill(ids[:, :36])
    for i in range(36, 40):
        logits = model.module.step(ids[0, i : i + 1], s3)
    assert (logits - whole).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kv", DTYPES)
def test_the_native_step_over_a_stored_cache_equals_the_eager_one(checkpoint: Path, kv: str
                                                                  ) -> None:
    """decoder_step.cpp reads and writes bf16 / int8 rows as KVEntry does: 3 rows at other
    positions, 10 steps, logits within 1e-4 and the caches read back within one rounding
    step of each other (a key that differs by fp32 rounding may round to the next level)."""
    if not kernels.load():
        pytest.skip("native kernels unavailable")
    model = _load(checkpoint, kv).module
    gen = torch.Generator().manual_seed(8)
    state = State.cat([model.prefill(torch.randint(0, 8192, (1, n), generator=gen))[1]
                       for n in (3, 40, 70)])
    native, eager = state.copy(), state.copy()
    for _ in range(10):
        tokens = torch.randint(0, 8192, (3,), generator=gen)
        a, b = model.step(tokens, native), model.step_eager(tokens, eager)
        assert (a - b).abs().max().item() <= 1e-4
    for mine, theirs in zip(native.kv_entries, eager.kv_entries, strict=True):
        assert mine.dtype == theirs.dtype == kv
        n = int(native.lengths.max())
        for name in ("k", "v"):
            x, y = mine.read(name, slice(None), slice(0, n)), theirs.read(name, slice(None),
                                                                           slice(0, n))
            step = y.abs().amax() / (127 if kv == "int8" else 128)
            assert (x - y).abs().max().item() <= step.item() + 1e-5


@pytest.mark.parametrize("kv", DTYPES)
def test_a_rows_native_step_over_a_stored_cache_does_not_depend_on_the_batch(
        checkpoint: Path, kv: str) -> None:
    """Each row's logits and cache are the same bits alone as beside other rows."""
    if not kernels.load():
        pytest.skip("native kernels unavailable")
    model = _load(checkpoint, kv).module
    gen = torch.Generator().manual_seed(9)
    rows = [model.prefill(torch.randint(0, 8192, (1, n), generator=gen))[1]
            for n in (2, 30, 65, 129)]
    batch = State.cat([r.copy() for r in rows])
    tokens = torch.randint(0, 8192, (4,), generator=gen)
    together = model.step(tokens, batch)
    for i, row in enumerate(rows):
        alone = model.step(tokens[i : i + 1], row)
        assert torch.equal(alone[0], together[i])
        for a, b in zip(row.kv_entries, batch.kv_entries, strict=True):
            n = int(row.lengths[0])
            assert torch.equal(a.k[0, :, :n], b.k[i, :, :n])


@pytest.mark.parametrize("kv", DTYPES)
def test_stored_caches_round_trip_and_cross_dtypes_in_blobs(checkpoint: Path, kv: str) -> None:
    """A stored cache's blob reads back bit for bit; read by a server with another dtype it
    is converted (what was stored, read back and stored again); a blob written before
    caches had a dtype reads as fp32; a corrupt int8 scale is refused."""
    model = _load(checkpoint, kv)
    ids = torch.randint(0, 8192, (1, 20), generator=torch.Generator().manual_seed(5))
    _, state = model.prefill(ids)
    blob = model.state_to_bytes(state)
    back, _ = model.state_from_bytes(blob)
    assert all(torch.equal(a, b) for a, b in zip(state.tensors().values(),
                                                 back.tensors().values(), strict=True))
    fp32 = _load(checkpoint, "fp32")
    there, _ = fp32.state_from_bytes(blob)
    for mine, theirs in zip(there.kv_entries, state.kv_entries, strict=True):
        assert mine.dtype == "fp32"
        assert torch.equal(mine.keys(slice(None), 20), theirs.keys(slice(None), 20))
    layout = [{n: {k: v for k, v in d.items() if k != "dtype"} for n, d in layer.items()}
              for layer in there.layout()]
    old = st_save({k: v.contiguous() for k, v in there.tensors().items()}, metadata={
        "format_version": "3", "fingerprint": fp32.fingerprint(),
        "layout": json.dumps(layout), "extra": "{}"})
    assert fp32.state_from_bytes(old)[0].kv_entries[0].dtype == "fp32"
    if kv == "int8":
        entry = state.kv_entries[0]
        with torch.inference_mode():
            entry.k[0, 0, 0, -4:] = torch.tensor([0, 0, -64, 127], dtype=torch.int8)  # NaN
        with pytest.raises(StateError, match="NaN"):
            state_from_bytes(model.state_to_bytes(state), model.new_state(), model.fingerprint())


def test_stored_caches_keep_the_next_token_distributions(checkpoint: Path) -> None:
    """After a 300-token prompt the next-token distribution over a bf16 / int8 cache stays
    close to the fp32 cache's (KL well under what bf16 weights cost, 1e-2)."""
    ids = torch.randint(0, 8192, (1, 300), generator=torch.Generator().manual_seed(6))
    want = torch.log_softmax(_load(checkpoint, "fp32").prefill(ids)[0], -1)
    for kv, bound in (("bf16", 1e-3), ("int8", 1e-2)):
        got = torch.log_softmax(_load(checkpoint, kv).prefill(ids)[0], -1)
        kl = (want.exp() * (want - got)).sum(-1).max().item()
        assert kl <= bound, (kv, kl)


@pytest.mark.parametrize("kv", DTYPES)
def test_the_softmax_baselines_forms_agree_over_a_stored_cache(kv: str) -> None:
    """The shipped softmax baseline (every layer attention; its step eager over a stored
    cache, the fused kernel reading fp32 only): a prompt whole and in chunks give its
    logits within fp32 rounding (its parallel form is not split-invariant, fp32 cache or
    not), and so do its last tokens stepped over a bf16 cache. Over an int8 cache a key the
    two forms compute 1e-6 apart may round to the next level: the caches they leave agree
    within one level, and the logits within what one level moves them (1e-3)."""
    from tests.paths import ROOT

    model = _load(ROOT / "weights" / "softmax", kv)
    assert model.info.decode_step == "eager" and model.info.kv_cache_dtype == kv
    ids = torch.randint(0, 8192, (1, 40), generator=torch.Generator().manual_seed(4))
    whole, done = model.prefill(ids)
    _, state = model.prefill(ids[:, :17])
    tail, state = model.prefill(ids[:, 17:], state)
    assert (whole - tail).abs().max().item() <= 1e-4
    _, state = model.prefill(ids[:, :37])
    for i in range(37, 40):
        logits = model.step(ids[0, i : i + 1], state)
    gap = (logits - whole).abs().max().item()
    if kv == "bf16":
        assert gap <= 1e-4
        return
    for mine, theirs in zip(state.kv_entries, done.kv_entries, strict=True):
        x, y = mine.keys(slice(None), 40), theirs.keys(slice(None), 40)
        assert (x - y).abs().max().item() <= y.abs().amax().item() / 127 + 1e-6
    assert gap <= 1e-3
