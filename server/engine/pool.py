"""A batched state with one row per running sequence, kept contiguous.

Rows ``[0, n)`` are live; a decode step runs on the view of those rows, updating the pool in
place. Removing row i moves the last row into it (one row copy), so no step ever gathers or
scatters the whole batch.
"""

from __future__ import annotations

import torch

from model.interface import ServedModel, State

ROW_BLOCK = 4


class SlotPool:
    """A batched state of up to ``capacity`` rows plus per-row penalty bookkeeping.

    ``counts [rows, V]`` counts generated tokens (presence/frequency penalties) and
    ``seen [rows, V]`` marks prompt or generated tokens (repetition penalty).

    Rows are allocated as sequences join, in blocks of :data:`ROW_BLOCK` (growing by at
    least a quarter, so n joins copy O(n) rows in all), and given back when fewer than half
    are live: a constant-state row of Qwen3.5-0.8B is 20.6 MB, and 64 rows reserved up front
    held 1.3 GB while the server idled.
    """

    def __init__(self, model: ServedModel, capacity: int) -> None:
        self.model = model
        self.capacity = capacity
        self.n = 0
        self._view: State | None = None
        self.state: State = model.new_state(0)
        self.counts = torch.zeros(0, model.info.vocab_size)
        self.seen = torch.zeros(0, model.info.vocab_size, dtype=torch.bool)

    @property
    def rows(self) -> int:
        """Rows allocated (live or not)."""
        return self.state.batch_size

    def _allocate(self, rows: int) -> None:
        """Reallocate to ``rows`` rows, copying the live ones."""
        state = self.model.new_state(rows)
        counts = torch.zeros(rows, self.model.info.vocab_size)
        seen = torch.zeros(rows, self.model.info.vocab_size, dtype=torch.bool)
        if self.n:
            live = self.state.rows(self.n)
            state.reserve_like(live)
            state.write_rows(slice(0, self.n), live)
            counts[: self.n] = self.counts[: self.n]
            seen[: self.n] = self.seen[: self.n]
        self.state, self.counts, self.seen = state, counts, seen
        self._view = None

    def _grow_for(self, rows: int) -> None:
        if rows > self.rows:
            want = max(rows, self.rows + self.rows // 4)
            self._allocate(min(self.capacity, -(-want // ROW_BLOCK) * ROW_BLOCK))

    def _shrink(self) -> None:
        """Give rows back once fewer than half are live (and the KV cache's slots past the
        longest live row, once those are more than half of them)."""
        if self.n * 2 <= self.rows - ROW_BLOCK:
            self._allocate(-(-self.n // ROW_BLOCK) * ROW_BLOCK)
        elif self.state.fit_kv(self.n):
            self._view = None

    def view(self) -> State:
        """The live rows ``[0, n)`` as a state sharing the pool's memory (kept between steps
        until a row joins or leaves, or a KV cache grows)."""
        if self._view is None or self._view.batch_size != self.n:
            self._view = self.state.rows(self.n)
        return self._view

    def reserve_step(self) -> None:
        """Make sure every live row has room for one more token (KV caches grow)."""
        if self.state.reserve_step(self.n):
            self._view = None

    def add(self, row: State, seen_ids: list[int], generated: list[int]) -> int:
        """Append a single-row state; returns its slot."""
        if self.n >= self.capacity:
            raise RuntimeError("slot pool is full")
        slot = self.n
        self._grow_for(slot + 1)
        self.state.reserve_like(row, live=slot)  # a KV cache grows copying live rows only
        self.state.write_rows(slice(slot, slot + 1), row)
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        if seen_ids:
            self.seen[slot, torch.tensor(seen_ids)] = True
        for tok in generated:
            self.counts[slot, tok] += 1
            self.seen[slot, tok] = True
        self.n += 1
        self._view = None
        return slot

    def take(self, slot: int) -> State:
        """A standalone copy of one row (e.g. to save a session)."""
        return self.view().select([slot])

    def remove(self, slot: int) -> int | None:
        """Free ``slot``; the last row moves into it. Returns the slot that moved (or None)."""
        last = self.n - 1
        if slot != last:
            self.state.move_row(last, slot)
            self.counts[slot] = self.counts[last]
            self.seen[slot] = self.seen[last]
        self.n -= 1
        self._view = None
        self.state.lengths[self.n] = 0
        self._shrink()
        return last if slot != last else None

    def record(self, tokens: torch.Tensor) -> None:
        """Count the tokens ``[n]`` just sampled for the live rows."""
        rows = torch.arange(self.n)
        self.counts[rows, tokens] += 1
        self.seen[rows, tokens] = True
