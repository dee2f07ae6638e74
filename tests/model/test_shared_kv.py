"""The states of one chunked prefill share one buffer of keys and values (``SharedKV``):
what each state reads never changes, whoever writes after it; a state that may not write
the buffer copies it first; and the outputs are those of unshared states, bit for bit."""

from __future__ import annotations

import pytest
import torch

from linserve.model.state import KVEntry, State
from linserve.server.prefix_cache.engine_side import memory_parts
from tests.model.helpers import tiny_model

TOKENS = torch.randint(0, 97, (1, 96), generator=torch.Generator().manual_seed(3))


def _buffers(state: State) -> set[int]:
    return {e.k.untyped_storage().data_ptr() for e in state.kv_entries}


def _frozen(state: State) -> State:
    """``state`` kept as the prefix cache keeps it (trimmed), and a private copy of it."""
    state.trim_kv()
    return state.copy()


def _same(a: State, b: State) -> bool:
    n = int(a.lengths[0])
    return all(torch.equal(x.keys(slice(None), n), y.keys(slice(None), n)) and
               torch.equal(x.values(slice(None), n), y.values(slice(None), n))
               for x, y in zip(a.kv_entries, b.kv_entries, strict=True))


def test_a_chunked_prefill_writes_one_buffer_and_equals_the_whole() -> None:
    model = tiny_model("softmax")
    whole, _ = model.prefill(TOKENS)
    _, s1 = model.prefill(TOKENS[:, :32], room=96)
    kept1 = _frozen(s1)
    _, s2 = model.prefill(TOKENS[:, 32:64], s1, room=64)
    kept2 = _frozen(s2)
    last, s3 = model.prefill(TOKENS[:, 64:], s2, room=32)
    assert _buffers(s1) == _buffers(s2) == _buffers(s3)
    assert torch.equal(last, whole)
    assert _same(s1, kept1) and _same(s2, kept2)  # later chunks wrote past them only
    parts = [memory_parts(s) for s in (s1, s2, s3)]
    kv = set(parts[0]) & set(parts[1]) & set(parts[2])
    assert len(kv) == 2 * len(s1.kv_entries)  # k and v of each layer, held once


def test_a_second_branch_from_a_kept_state_writes_its_own_copy() -> None:
    model = tiny_model("softmax")
    _, base = model.prefill(TOKENS[:, :40], room=96)
    kept = _frozen(base)
    logits_a, a = model.prefill(TOKENS[:, 40:60], base, room=56)
    _frozen(a)
    other = TOKENS[:, 60:80]
    logits_b, b = model.prefill(other, base)  # the buffer went on past `base`: a copy
    assert _buffers(b).isdisjoint(_buffers(base))
    ref_logits, ref = model.prefill(other, kept)
    assert torch.equal(logits_b, ref_logits) and _same(b, ref)
    assert _same(base, kept)
    again, _ = model.prefill(TOKENS[:, 40:60], kept)
    assert torch.equal(logits_a, again)


def test_a_state_stepped_in_place_after_handing_its_buffer_on_copies_it() -> None:
    model = tiny_model("softmax")
    _, s1 = model.prefill(TOKENS[:, :30], room=64)
    _, s2 = model.prefill(TOKENS[:, 30:50], s1, room=34)
    before = s2.copy()
    s1_ref = s1.copy()
    a = model.step(TOKENS[:, 30], s1)  # s1 no longer owns the buffer
    b = model.step(TOKENS[:, 30], s1_ref)
    assert torch.equal(a, b)
    assert _buffers(s1).isdisjoint(_buffers(s2))
    assert _same(s2, before)


def test_cutting_back_a_shared_state_leaves_the_others_alone() -> None:
    model = tiny_model("softmax")
    _, s1 = model.prefill(TOKENS[:, :30], room=64)
    kept = _frozen(s1)
    _, s2 = model.prefill(TOKENS[:, 30:50], s1, room=34)
    with torch.inference_mode():
        s2.truncate(20)  # below s1's 30: rewriting there would change what s1 reads
    model.step(TOKENS[:, 70], s2)
    assert _same(s1, kept)


def test_a_ring_is_never_shared() -> None:
    model = tiny_model("window")
    _, s1 = model.prefill(TOKENS[:, :30], room=60)
    _, s2 = model.prefill(TOKENS[:, 30:60], s1)
    assert _buffers(s1).isdisjoint(_buffers(s2))
    _, whole = model.prefill(TOKENS[:, :60])
    a, b = model.step(TOKENS[:, 60], s2), model.step(TOKENS[:, 60], whole)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # chunked and whole: fp32 rounding


def test_every_kv_dtype_shares() -> None:
    for dtype in ("fp32", "bf16", "int8"):
        model = tiny_model("softmax", d_model=64)  # a head of 32: int8 blocks fit
        model.kv_dtype = dtype
        _, s1 = model.prefill(TOKENS[:, :32], room=64)
        kept = _frozen(s1)
        _, s2 = model.prefill(TOKENS[:, 32:64], s1)
        assert _buffers(s1) == _buffers(s2), dtype
        assert _same(s1, kept)
        assert all(isinstance(e, KVEntry) and e.dtype == s1.kv_dtype for e in s2.kv_entries)


def test_room_is_a_hint_but_the_context_is_a_limit() -> None:
    model = tiny_model("softmax", max_context=64)
    _, s1 = model.prefill(TOKENS[:, :40], room=500)  # room past the context: capped
    assert s1.kv_entries[0].shared is not None
    assert s1.kv_entries[0].shared.k.shape[2] <= 256
    with pytest.raises(ValueError, match="exceeds max_context"):
        model.prefill(TOKENS[:, 40:90], s1)
