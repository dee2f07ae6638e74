"""The engine's side of the memory report: the bytes its tensors hold, part by part.

Parts (``linserve_memory_bytes{part=…}`` and ``/health``'s ``memory``; the HTTP process adds
``sessions`` and the ``runtime``, see :mod:`linserve.server.system.memory`):

- ``weights``: the GEMM weights as packed (quantized), norms and the other parameters;
- ``embeddings``: an embedding table held beside them (0 for a tied table held once);
- ``slot_states``: the slot pool's constant-size states and its penalty counts;
- ``kv_cache``: the slot pool's KV caches (what running requests' contexts hold);
- ``request_states``: states held for requests outside the pool (prompts being prefilled,
  a prompt's state kept to rebuild a session, replays);
- ``prefix_cache``: the prefix-state cache's entries.

A tensor shared by two parts (a prefix entry that is also a request's snapshot) is counted
once, in the first part that holds it, in the order above.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from linserve.model.info import ModelInfo

if TYPE_CHECKING:  # the HTTP process reads ENGINE_PARTS without them
    import torch

    from linserve.model.state import State

ENGINE_PARTS = ("weights", "embeddings", "slot_states", "kv_cache", "request_states",
                "prefix_cache")


class StorageCounter:
    """Bytes of tensors' storages, each storage counted once across calls."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def count(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            total += storage.nbytes()
        return total

    def states(self, states: Iterable[State | None]) -> int:
        return self.count(t for st in states if st is not None
                          for t in st.tensors().values())


def engine_parts(info: ModelInfo, pool_state: State, pool_extra: list[torch.Tensor],
                 request_states: Iterable[State | None], prefix_states: Iterable[State]
                 ) -> dict[str, int]:
    """The engine's parts in bytes (see the module docstring). ``pool_extra``: the pool's
    per-row bookkeeping tensors."""
    counter = StorageCounter()
    kv = [t for e in pool_state.kv_entries for t in e.tensors().values()]
    kv_bytes = counter.count(kv)
    pool = counter.states([pool_state]) + counter.count(pool_extra)
    requests = counter.states(request_states)
    return {"weights": info.weight_bytes - info.embedding_bytes,
            "embeddings": info.embedding_bytes, "slot_states": pool, "kv_cache": kv_bytes,
            "request_states": requests, "prefix_cache": counter.states(prefix_states)}
