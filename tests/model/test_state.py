"""State export/import, fingerprints, and batching operations."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from model.state import StateError, state_from_bytes, state_to_bytes, unbatch
from tests.model.helpers import tiny_model


@pytest.mark.parametrize("kind", ["linear", "favor", "gated", "softmax", "window"])
def test_export_import_continue_equals_uninterrupted(kind: str) -> None:
    model = tiny_model(kind)
    tokens = torch.randint(0, 97, (1, 60))  # past the window's 24 slots: the ring has wrapped
    _, state = model.prefill(tokens[:, :40])
    blob = state_to_bytes(state, model.fingerprint(), {"tokens": 40})
    restored, extra = state_from_bytes(blob, model.cfg, model.fingerprint())
    assert extra == {"tokens": 40}
    for t in range(40, 60):
        a = model.step(tokens[:, t], state)
        b = model.step(tokens[:, t], restored)
        assert torch.equal(a, b)


def _rewrite_meta(blob: bytes, **meta: str | None) -> bytes:
    """The same tensors with metadata fields replaced (None: removed)."""
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    for key, value in meta.items():
        if value is None:
            header.pop(key, None)
        else:
            header[key] = value
    return st_save(st_load(blob), metadata=header)


def test_format_version_1_blobs_still_load() -> None:
    """Version 2 added the window to KV-cache blobs; a version 1 blob (no window field) from
    a model without a window loads and continues exactly."""
    for kind in ("linear", "softmax"):
        model = tiny_model(kind)
        _, state = model.prefill(torch.randint(0, 97, (1, 30)))
        old = _rewrite_meta(state_to_bytes(state, model.fingerprint()), format_version="1",
                            window=None)
        restored, _ = state_from_bytes(old, model.cfg, model.fingerprint())
        tok = torch.tensor([5])
        assert torch.equal(model.step(tok, restored), model.step(tok, state))
    model = tiny_model("linear")
    blob = _rewrite_meta(state_to_bytes(model.new_state(1), model.fingerprint()),
                         format_version="3")
    with pytest.raises(StateError, match="format version '3'"):
        state_from_bytes(blob, model.cfg, model.fingerprint())


def test_a_ring_cache_of_another_window_is_rejected() -> None:
    model = tiny_model("window")
    _, state = model.prefill(torch.randint(0, 97, (1, 30)))
    blob = _rewrite_meta(state_to_bytes(state, model.fingerprint()), window="0")
    with pytest.raises(StateError, match="window"):
        state_from_bytes(blob, model.cfg, model.fingerprint())


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_state_from_another_model_is_rejected(kind: str) -> None:
    a, b = tiny_model(kind, seed=0), tiny_model(kind, seed=1)
    _, state = a.prefill(torch.randint(0, 97, (1, 5)))
    blob = state_to_bytes(state, a.fingerprint())
    with pytest.raises(StateError, match="different model"):
        state_from_bytes(blob, b.cfg, b.fingerprint())


def test_state_of_another_kind_or_shape_is_rejected() -> None:
    lin, soft = tiny_model("linear"), tiny_model("softmax")
    _, state = soft.prefill(torch.randint(0, 97, (1, 5)))
    with pytest.raises(StateError, match="kind"):
        state_from_bytes(state_to_bytes(state, lin.fingerprint()), lin.cfg, lin.fingerprint())
    _, lstate = lin.prefill(torch.randint(0, 97, (1, 5)))
    lstate.s = lstate.s[:, :, :, :4]  # type: ignore[union-attr]  # wrong feature size
    with pytest.raises(StateError, match="shape"):
        state_from_bytes(state_to_bytes(lstate, lin.fingerprint()), lin.cfg, lin.fingerprint())
    _, lstate = lin.prefill(torch.randint(0, 97, (1, 5)))
    lstate.z = lstate.z.double()  # type: ignore[union-attr]
    with pytest.raises(StateError, match="dtype"):
        state_from_bytes(state_to_bytes(lstate, lin.fingerprint()), lin.cfg, lin.fingerprint())


@pytest.mark.parametrize("blob", [b"", b"\x00" * 7, b"\xff" * 64, b"garbage bytes here",
                                  (10**9).to_bytes(8, "little") + b"{}"])
def test_garbage_blobs_are_rejected(blob: bytes) -> None:
    model = tiny_model("linear")
    with pytest.raises(StateError):
        state_from_bytes(blob, model.cfg, model.fingerprint())


def test_truncated_blob_is_rejected() -> None:
    model = tiny_model("linear")
    _, state = model.prefill(torch.randint(0, 97, (1, 5)))
    blob = state_to_bytes(state, model.fingerprint())
    for cut in (len(blob) // 2, len(blob) - 1, 20):
        with pytest.raises(StateError):
            state_from_bytes(blob[:cut], model.cfg, model.fingerprint())


def test_select_copy_unbatch_are_independent() -> None:
    model = tiny_model("linear")
    _, state = model.prefill(torch.randint(0, 97, (3, 8)))
    rows = unbatch(state)
    assert [r.batch_size for r in rows] == [1, 1, 1]
    fork = rows[1].copy()
    model.step(torch.tensor([5]), fork)
    assert torch.equal(rows[1].s, state.s[:, 1:2])  # type: ignore[union-attr]
    assert not torch.equal(fork.s, rows[1].s)  # type: ignore[union-attr]
    picked = state.select([2, 0])
    assert torch.equal(picked.s[:, 0], state.s[:, 2])  # type: ignore[union-attr]
