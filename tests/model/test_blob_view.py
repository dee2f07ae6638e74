"""The HTTP process's view of a state (:mod:`linserve.model.blob_view`): the blob the engine
writes, read and compressed without torch, losslessly, and continued bit for bit."""

from __future__ import annotations

import asyncio

import pytest
import torch

from linserve.model.blob_view import StateBlob
from linserve.model.state import ConvEntry, RecurrentEntry, State
from linserve.model.state_blob import state_from_bytes, state_to_bytes
from linserve.server.sessions.store import MemorySessionStore, Session
from tests.model.helpers import tiny_model


def blob(state: State, extra: dict[str, object] | None = None) -> StateBlob:
    return StateBlob(state_to_bytes(state, "fp", extra))


@pytest.mark.parametrize("kind", ["linear", "favor", "gated", "softmax", "window"])
def test_pack_unpack_is_bit_identical_and_continues_the_same(kind: str) -> None:
    model = tiny_model(kind)
    tokens = torch.randint(0, 97, (2, 50))
    _, state = model.prefill(tokens[:, :30])
    held = blob(state)
    assert held.rows == 2 and held.lengths == [30, 30] and held.fingerprint == "fp"
    again = held.pack().unpack()
    assert again.data == held.data
    restored, _ = state_from_bytes(again.data, model.new_state(1), "fp")
    for name, t in state.tensors().items():
        got = restored.tensors()[name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t), name
    for t in range(30, 50):
        assert torch.equal(model.step(tokens[:, t], state), model.step(tokens[:, t], restored))


def test_special_values_survive() -> None:
    s = torch.tensor([0.0, -0.0, 1e-45, -3.4e38, float("inf"), float("nan")]).repeat(4)
    state = State([{"recurrent": RecurrentEntry(s.reshape(1, 1, 4, 6), torch.ones(1, 1, 4)),
                    "conv": ConvEntry(torch.empty(1, 0, 3))}], torch.zeros(1, dtype=torch.long))
    held = blob(state)
    assert held.pack().unpack().data == held.data  # NaN bits included


def test_extra_is_rewritten_without_touching_the_tensors() -> None:
    """An export's tokens and transcript go into the header; the state reads back the same."""
    model = tiny_model("softmax")
    _, state = model.prefill(torch.randint(0, 97, (1, 20)))
    held = blob(state, {"tokens": 20})
    out = held.with_extra({"tokens": 21, "pending": [3], "chat": {"text": "é"}})
    assert out.extra() == {"tokens": 21, "pending": [3], "chat": {"text": "é"}}
    assert out.tokens == 20 and out.nbytes == held.nbytes
    got, extra = state_from_bytes(out.data, model.new_state(1), "fp")
    assert extra["pending"] == [3]
    assert all(torch.equal(got.tensors()[k], v) for k, v in state.tensors().items())


def test_a_real_length_state_packs_smaller() -> None:
    model = tiny_model("linear", d_model=64, n_heads=2)
    _, state = model.prefill(torch.randint(0, 97, (1, 500)))
    held = blob(state)
    assert held.pack().nbytes < 0.97 * held.nbytes


def test_memory_store_holds_compressed_bytes_and_returns_the_exact_state() -> None:
    model = tiny_model("linear", d_model=64, n_heads=2)
    _, state = model.prefill(torch.randint(0, 97, (1, 300)))
    held = blob(state)

    async def scenario() -> None:
        store = MemorySessionStore(max_bytes=1 << 30, ttl=60)
        saved = await store.put(Session("sess_a", "", held, [5], 301))
        assert saved.version == 1
        n, stored = await store.stats()
        assert n == 1 and stored < held.nbytes
        got = await store.get("sess_a", "")
        assert got is not None and got.pending == [5] and got.tokens == 301
        assert got.state.data == held.data

    asyncio.run(scenario())


def test_a_session_read_as_free_is_the_saved_one() -> None:
    """``status`` never reports a session free while holding what it held before a save:
    here a request saves and releases it in the middle of the status read (CI saw a
    hang-up's session read as free with none of the tokens sent)."""
    state = blob(tiny_model("linear").prefill(torch.randint(0, 97, (1, 8)))[1])

    class SavingMidRead(MemorySessionStore):
        save: Session | None = None

        async def get(self, session_id: str, owner: str) -> Session | None:
            got = await super().get(session_id, owner)
            if self.save is not None:  # the request's save lands while this read is out
                save, self.save = self.save, None
                await self.put(save)
                await self.release(session_id, lock)
            return got

    async def scenario() -> tuple[Session | None, bool]:
        store = SavingMidRead(max_bytes=1 << 30, ttl=60)
        old = await store.put(Session("s", "", state, [], 8))
        nonlocal lock
        lock = await store.acquire("s") or ""
        store.save = Session("s", "", state, [], 10, version=old.version)
        return await store.status("s", "")

    lock = ""
    sess, busy = asyncio.run(scenario())
    assert sess is not None
    assert busy or sess.tokens == 10, "read as free, holding the state from before the save"
