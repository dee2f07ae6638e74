"""A batched state with one row per running sequence, kept contiguous.

Rows ``[0, n)`` are live; a decode step runs on the view of those rows, updating the pool in
place. Removing row i moves the last row into it (one row copy), so no step ever gathers or
scatters the whole batch.

The rows are allocated as sequences join, not all at start: the pool doubles when full (up
to ``max_rows``) and halves when three quarters of it stand empty, copying only live rows.
A Mamba2 hybrid's row is large (Granite-4.0-H-Micro: 75 MB), so 64 preallocated rows held
4.8 GB where 16 streams use 1.2 GB.

A KV cache has one capacity for every row, the longest row's, so a spare row costs as much
as that row's context: one 4,000-token prompt on Qwen3.5's shapes held 384 MB of KV in the
four rows of the pool's floor where its own row needs 98 MB. Past :data:`SPARE_KV_SLOTS`
slots the pool keeps at most a quarter of its live rows spare (none for one row): it drops
the others before a KV cache grows, and grows by a quarter, not by doubling, when a sequence
joins (so joins still copy the live rows only a bounded number of times). When the rows
that grew the KV caches leave, past those slots, the caches are cut back to what the live
rows use.
"""

from __future__ import annotations

import torch

from linserve.model.interface import ServedModel, State

MIN_ROWS = 4  # rows allocated at start, and the least the pool shrinks to
SPARE_KV_SLOTS = 1024  # a KV capacity past which the pool holds no rows but live ones


class SlotPool:
    """A batched state of up to ``max_rows`` rows plus per-row penalty bookkeeping.

    ``counts [rows, V]`` counts generated tokens (presence/frequency penalties) and
    ``seen [rows, V]`` marks prompt or generated tokens (repetition penalty). ``rows`` (the
    allocated rows) grows and shrinks with ``n``; see the module docstring.
    """

    def __init__(self, model: ServedModel, max_rows: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.floor = min(MIN_ROWS, max_rows)
        self.clear()

    def clear(self) -> None:
        """Drop every row: the pool as new, ``floor`` rows allocated afresh."""
        self.state: State = self.model.new_state(self.floor)
        vocab = self.model.info.vocab_size
        self.counts = torch.zeros(self.floor, vocab)
        self.seen = torch.zeros(self.floor, vocab, dtype=torch.bool)
        self.n = 0
        self._view: State | None = None

    @property
    def rows(self) -> int:
        """Rows allocated (``n`` of them live)."""
        return self.state.batch_size

    def _resize(self, rows: int) -> None:
        """Reallocate to ``rows`` rows, keeping the live ones."""
        self.state.resize_rows(rows, self.n)
        for name in ("counts", "seen"):
            old = getattr(self, name)
            new = old.new_zeros(rows, old.shape[1])
            new[: self.n] = old[: self.n]
            setattr(self, name, new)
        self._view = None

    def view(self) -> State:
        """The live rows ``[0, n)`` as a state sharing the pool's memory (kept between steps
        until a row joins or leaves, or a KV cache grows)."""
        if self._view is None or self._view.batch_size != self.n:
            self._view = self.state.rows(self.n)
        return self._view

    def reserve_step(self, tokens: int = 1) -> None:
        """Make sure every live row has room for ``tokens`` more (KV caches grow)."""
        if self.n:
            self._drop_spares(int(self.state.lengths[: self.n].max()) + tokens,
                              self.n + self.n // 4)
        if self.state.reserve_step(self.n, tokens):
            self._view = None

    def _long(self, *states: State) -> bool:
        """Whether a KV cache of the pool (or of ``states``) holds more than
        :data:`SPARE_KV_SLOTS` slots a row: spare rows then cost a long context each."""
        return any(e.capacity > SPARE_KV_SLOTS for st in (self.state, *states)
                   for e in st.kv_entries if not e.window)

    def _drop_spares(self, positions: int, keep: int) -> None:
        """Before KV caches grow past :data:`SPARE_KV_SLOTS` to hold ``positions``, give
        back the rows past ``keep`` (each would grow too)."""
        grows = [e for e in self.state.kv_entries if not e.window and e.capacity < positions]
        if grows and positions > SPARE_KV_SLOTS and self.rows > keep:
            self._resize(max(keep, 1))

    def add(self, row: State, seen_ids: list[int], generated: list[int]) -> int:
        """Append a single-row state; returns its slot."""
        if self.n >= self.max_rows:
            raise RuntimeError("slot pool is full")
        if self._long(row):  # few spare rows: each costs a long context
            live = self.n + 1
            if self.n == self.rows or self.rows > live + live // 4:
                self._resize(min(live + live // 4, self.max_rows))
        elif self.n == self.rows:
            self._resize(min(2 * self.rows, self.max_rows))
        slot = self.n
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
        rows = self.rows
        while rows > self.floor and self.n <= rows // 4:
            rows //= 2
        if self._long() and rows > self.n + self.n // 4:
            rows = max(self.n + self.n // 4, 1)
        if rows != self.rows:
            self._resize(rows)
            self.state.trim_kv()  # and the KV slots the rows that left had grown
        elif self._slack():
            self.state.trim_kv()
            self._view = None
        return last if slot != last else None

    def _slack(self) -> bool:
        """Whether the KV caches hold more than :data:`SPARE_KV_SLOTS` slots and twice what
        the live rows use: the rows that grew them have left (one 30,000-token prompt's
        slots stayed held by an idle pool: 360 MB on Qwen3.5-0.8B's shapes in bf16)."""
        used = int(self.state.lengths[: self.n].max()) if self.n else 0
        return any(e.capacity > max(SPARE_KV_SLOTS, 2 * used)
                   for e in self.state.kv_entries if not e.window)

    def record(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Count the tokens ``[n]`` just sampled for the live rows (or for ``rows``)."""
        rows = torch.arange(self.n) if rows is None else rows
        self.counts[rows, tokens] += 1
        self.seen[rows, tokens] = True
