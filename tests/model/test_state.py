"""State export/import, fingerprints, and batching operations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from linserve.model.fingerprint import HEAD, WINDOW, WINDOWS, files_fingerprint
from linserve.model.state import KVEntry, RecurrentEntry, State, StateError
from linserve.model.state_blob import state_from_bytes as _from_bytes
from linserve.model.state_blob import state_to_bytes
from tests.model.helpers import tiny_model


@pytest.mark.parametrize("kind", ["linear", "favor", "gated", "softmax", "window"])
def test_export_import_continue_equals_uninterrupted(kind: str) -> None:
    model = tiny_model(kind)
    tokens = torch.randint(0, 97, (1, 60))  # past the window's 24 slots: the ring has wrapped
    _, state = model.prefill(tokens[:, :40])
    blob = state_to_bytes(state, model.fingerprint(), {"tokens": 40})
    restored, extra = state_from_bytes(blob, model, model.fingerprint())
    assert extra == {"tokens": 40}
    for t in range(40, 60):
        a = model.step(tokens[:, t], state)
        b = model.step(tokens[:, t], restored)
        assert torch.equal(a, b)


def state_from_bytes(blob: bytes, model: torch.nn.Module, fingerprint: str
                     ) -> tuple[State, dict[str, object]]:
    """Parse against the model's own empty state, as the server does."""
    return _from_bytes(blob, model.new_state(1), fingerprint)  # type: ignore[operator]


def _old_blob(state: State, fingerprint: str, version: str, window: str | None = "0") -> bytes:
    """The blob an earlier server wrote: stacked ``s``/``z``/``conv`` ``[L, B, ...]``, or
    ``k``/``v`` ``[B, L, ...]`` and ``lengths`` for a KV cache."""
    layers = state.layers
    if "kv" in layers[0]:
        tensors = {t: torch.stack([getattr(layer["kv"], t) for layer in layers], 1)
                   for t in ("k", "v")}
        tensors["lengths"] = state.lengths
        meta = {"kind": "softmax", **({"window": window} if window is not None else {})}
    else:
        tensors = {"s": torch.stack([layer["recurrent"].s for layer in layers]),  # type: ignore[attr-defined]
                   "z": torch.stack([layer["recurrent"].z for layer in layers]),  # type: ignore[attr-defined]
                   "conv": torch.stack([layer["conv"].window for layer in layers])}  # type: ignore[attr-defined]
        meta = {"kind": "linear"}
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata={
        "format_version": version, "fingerprint": fingerprint, "extra": "{}", **meta})


def _rewrite_meta(blob: bytes, **meta: str | None) -> bytes:
    """The same tensors with metadata fields replaced (None: removed)."""
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    for key, value in meta.items():
        if value is None:
            header.pop(key, None)
        else:
            header[key] = value
    return st_save(st_load(blob), metadata=header)


@pytest.mark.parametrize("version", ["1", "2"])
@pytest.mark.parametrize("kind", ["linear", "gated", "softmax", "window"])
def test_format_1_and_2_blobs_still_load(kind: str, version: str) -> None:
    """Blobs of earlier servers (stacked tensors; version 1 without the window field) load
    into per-layer entries and continue exactly (tests/server/test_exactness.py does the
    same through HTTP with blobs an earlier server really exported)."""
    if version == "1" and kind == "window":
        pytest.skip("version 1 predates window models")
    model = tiny_model(kind)
    _, state = model.prefill(torch.randint(0, 97, (1, 30)))
    window = str(model.cfg.window) if version == "2" else None
    restored, _ = state_from_bytes(_old_blob(state, model.fingerprint(), version, window),
                                   model, model.fingerprint())
    tok = torch.tensor([5])
    assert torch.equal(model.step(tok, restored), model.step(tok, state))
    blob = _rewrite_meta(state_to_bytes(model.new_state(1), model.fingerprint()),
                         format_version="4")
    with pytest.raises(StateError, match="format version '4'"):
        state_from_bytes(blob, model, model.fingerprint())


def test_a_ring_cache_of_another_window_is_rejected() -> None:
    model = tiny_model("window")
    _, state = model.prefill(torch.randint(0, 97, (1, 30)))
    with pytest.raises(StateError, match="window"):  # a format-2 blob of another window
        state_from_bytes(_old_blob(state, model.fingerprint(), "2", "0"), model,
                         model.fingerprint())
    layout = json.dumps([{"kv": {**e["kv"], "window": 0}} for e in state.layout()])
    blob = _rewrite_meta(state_to_bytes(state, model.fingerprint()), layout=layout)
    with pytest.raises(StateError, match="layout"):
        state_from_bytes(blob, model, model.fingerprint())


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_state_from_another_model_is_rejected(kind: str) -> None:
    a, b = tiny_model(kind, seed=0), tiny_model(kind, seed=1)
    _, state = a.prefill(torch.randint(0, 97, (1, 5)))
    blob = state_to_bytes(state, a.fingerprint())
    with pytest.raises(StateError, match="different model"):
        state_from_bytes(blob, b, b.fingerprint())


def test_state_of_another_kind_or_shape_is_rejected() -> None:
    lin, soft = tiny_model("linear"), tiny_model("softmax")
    _, state = soft.prefill(torch.randint(0, 97, (1, 5)))
    with pytest.raises(StateError, match="layout"):
        state_from_bytes(state_to_bytes(state, lin.fingerprint()), lin, lin.fingerprint())
    with pytest.raises(StateError, match="kind"):
        state_from_bytes(_old_blob(state, lin.fingerprint(), "2"), lin, lin.fingerprint())
    _, lstate = lin.prefill(torch.randint(0, 97, (1, 5)))
    rec = lstate.layers[0]["recurrent"]
    assert isinstance(rec, RecurrentEntry) and rec.z is not None
    rec.s = rec.s[:, :, :, :4]  # wrong feature size
    with pytest.raises(StateError, match="shape"):
        state_from_bytes(state_to_bytes(lstate, lin.fingerprint()), lin, lin.fingerprint())
    _, lstate = lin.prefill(torch.randint(0, 97, (1, 5)))
    rec = lstate.layers[1]["recurrent"]
    assert isinstance(rec, RecurrentEntry) and rec.z is not None
    rec.z = rec.z.double()
    with pytest.raises(StateError, match="dtype"):
        state_from_bytes(state_to_bytes(lstate, lin.fingerprint()), lin, lin.fingerprint())


@pytest.mark.parametrize("blob", [b"", b"\x00" * 7, b"\xff" * 64, b"garbage bytes here",
                                  (10**9).to_bytes(8, "little") + b"{}"])
def test_garbage_blobs_are_rejected(blob: bytes) -> None:
    model = tiny_model("linear")
    with pytest.raises(StateError):
        state_from_bytes(blob, model, model.fingerprint())


def test_truncated_blob_is_rejected() -> None:
    model = tiny_model("linear")
    _, state = model.prefill(torch.randint(0, 97, (1, 5)))
    blob = state_to_bytes(state, model.fingerprint())
    for cut in (len(blob) // 2, len(blob) - 1, 20):
        with pytest.raises(StateError):
            state_from_bytes(blob[:cut], model, model.fingerprint())


def test_select_copy_unbatch_are_independent() -> None:
    model = tiny_model("linear")
    _, state = model.prefill(torch.randint(0, 97, (3, 8)))
    rows = state.unbatch()
    assert [r.batch_size for r in rows] == [1, 1, 1]
    fork = rows[1].copy()
    model.step(torch.tensor([5]), fork)

    def s(st: State, layer: int = 0) -> torch.Tensor:
        return st.layers[layer]["recurrent"].s  # type: ignore[attr-defined, no-any-return]

    assert torch.equal(s(rows[1]), s(state)[1:2])
    assert not torch.equal(s(fork), s(rows[1]))
    picked = state.select([2, 0])
    assert torch.equal(s(picked)[0], s(state)[2])
    assert picked.lengths.tolist() == [8, 8]


def test_layers_may_mix_entry_types() -> None:
    """A state whose layers hold different entries (a hybrid) selects, concatenates, writes
    and serialises like any other, and knows it cannot be cut back."""
    rec = RecurrentEntry.empty(2, 2, 4, 4, with_z=False)
    kv = KVEntry.empty(2, 1, 4, max_context=64)
    state = State([{"recurrent": rec}, {"kv": kv}], torch.tensor([3, 5]))
    rec.s.normal_()
    kv.k.normal_()
    assert not state.truncatable and state.grows
    both = State.cat([state.select([1]), state.select([0])])
    assert torch.equal(both.layers[0]["recurrent"].s[0], rec.s[1])  # type: ignore[attr-defined]
    assert both.lengths.tolist() == [5, 3]
    blob = state_to_bytes(state, "fp")
    back, _ = _from_bytes(blob, State([{"recurrent": RecurrentEntry.empty(1, 2, 4, 4, False)},
                                       {"kv": KVEntry.empty(1, 1, 4, 64)}],
                                      torch.zeros(1, dtype=torch.long)), "fp")
    assert all(torch.equal(a, b) for a, b in zip(back.tensors().values(),
                                                 state.tensors().values(), strict=True))


def test_a_kept_state_gives_back_its_kv_room() -> None:
    """A prompt's state has KV room for growth (blocks of 256 slots); kept as a prefix-cache
    entry it is cut to what its rows use, rounded to 16, with its keys and values intact."""
    from linserve.model.state import KV_BLOCK

    kv = KVEntry.empty(2, 2, 8, 4096)
    st = State([{"kv": kv}], torch.tensor([20, 7]))
    st.reserve(21)
    assert kv.capacity == KV_BLOCK
    kv.k[:, :, :20] = torch.randn(2, 2, 20, 8)
    before = kv.k[:, :, :20].clone()
    st.trim_kv()
    assert kv.capacity == 32 and torch.equal(kv.k[:, :, :20], before)


def test_a_checkpoint_file_is_fingerprinted_by_its_size_head_and_windows(tmp_path: Path
                                                                          ) -> None:
    """A checkpoint's fingerprint reads a small file whole and a large one in a head and
    evenly spaced windows: any byte of those, its size or the config changes it; a byte
    between two windows does not (the trade for not reading gigabytes at every start)."""
    small = tmp_path / "small.bin"
    small.write_bytes(b"a" * 1000)
    first = files_fingerprint([small])
    small.write_bytes(b"a" * 999 + b"b")
    assert files_fingerprint([small]) != first
    big = tmp_path / "big.safetensors"
    with big.open("wb") as f:
        f.truncate(HEAD + 4 * WINDOWS * WINDOW)  # sparse: windows 4 WINDOW apart
    base = files_fingerprint([big])
    assert files_fingerprint([big], b"{}") != base

    def changed_at(at: int) -> bool:
        with big.open("r+b") as f:
            f.seek(at)
            f.write(b"x")
        out = files_fingerprint([big]) != base
        with big.open("r+b") as f:
            f.seek(at)
            f.write(b"\0")
        return out

    assert changed_at(10) and changed_at(HEAD + 5) and changed_at(big.stat().st_size - 1)
    assert not changed_at(HEAD + 2 * WINDOW)
    with big.open("ab") as f:
        f.write(b"\0")
    assert files_fingerprint([big]) != base
