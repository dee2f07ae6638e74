"""Draft proposers: what the served model is asked to verify.

A proposer drafts up to k tokens to follow a request's text so far (``history``: every token
it has seen and generated, ending with the pending token the next verify feeds first), and
hears back which of the fed tokens the served model kept (:meth:`Proposer.commit`).
Drafts are greedy (a proposer's distribution is one token), so verifying a draft by sampling
the served model's own distribution and comparing is Leviathan et al.'s rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from linserve.model.interface import DraftHead, ServedModel, State


class Proposer(Protocol):
    """``needs_hidden``: drafts from the served model's hidden states, so every step of a
    request it drafts for is a verify (which gives them); ``costly``: a draft costs model
    time (timed for :class:`~linserve.server.speculative.acceptance.CostModel`)."""

    needs_hidden: bool
    costly: bool

    def propose(self, key: str, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``history`` (possibly none)."""
        ...

    def commit(self, key: str, fed: list[int], after: int,
               hidden: torch.Tensor | None) -> None:
        """The served model consumed ``fed`` (the pending token and the drafts it kept)
        and ``after`` is the new pending token; ``hidden [len(fed), d]``: the final norm's
        output at the fed positions (where the verify gives it)."""
        ...

    def drop(self, key: str) -> None:
        """The request ``key`` left the batch."""
        ...


def ngram_lookup(history: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: for n from ``n_max`` down to ``n_min``, the up to ``k`` tokens that
    followed the latest earlier occurrence of the last n tokens of ``history`` (none found:
    ``[]``)."""
    arr = np.asarray(history, dtype=np.int64)
    size = len(arr)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = arr[size - n:]
        # starts s < size - n where arr[s : s + n] equals the tail
        starts = np.flatnonzero(arr[: size - n] == tail[0])
        for j in range(1, n):
            if not len(starts):
                break
            starts = starts[arr[starts + j] == tail[j]]
        if len(starts):
            s = int(starts[-1]) + n
            return arr[s: s + k].tolist()
    return []


class NgramProposer:
    """Drafts from the request's own text (vLLM's ``ngram`` method): free, and right where
    the output copies its input (rewrites, quotes, code edits)."""

    needs_hidden = False
    costly = False

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, key: str, history: list[int], k: int) -> list[int]:
        return ngram_lookup(history, k, self.n_max, self.n_min)

    def commit(self, key: str, fed: list[int], after: int,
               hidden: torch.Tensor | None) -> None:
        pass

    def drop(self, key: str) -> None:
        pass


@dataclass
class _DraftRow:
    """A request's draft state: it has consumed ``seen`` tokens of the history; ``trail``
    holds the states after each token of the last proposal's feed."""

    state: State
    seen: int
    trail: list[State] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy drafts from a smaller checkpoint with the same vocabulary (vLLM's
    ``draft_model``). Each request keeps its own draft state, which follows the tokens the
    served model keeps: a proposal steps a copy, and :meth:`commit` takes the copy's state
    at the kept position (one more step when every draft was kept)."""

    needs_hidden = False
    costly = True

    def __init__(self, draft: ServedModel) -> None:
        self.draft = draft
        self.rows: dict[str, _DraftRow] = {}

    def _row(self, key: str, history: list[int]) -> _DraftRow:
        """The request's draft state, caught up to all of ``history`` but its last token."""
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = _DraftRow(self.draft.new_state(1), 0)
        todo = history[row.seen: len(history) - 1]
        if todo:
            _, row.state = self.draft.prefill(torch.tensor([todo]), row.state)
            row.seen += len(todo)
        return row

    def propose(self, key: str, history: list[int], k: int) -> list[int]:
        row = self._row(key, history)
        state, token, out = row.state.copy(), history[-1], []
        row.trail, row.fed = [], []
        for _ in range(k):
            logits = self.draft.step(torch.tensor([token]), state)
            row.fed.append(token)
            row.trail.append(state.copy())
            token = int(torch.argmax(logits[0]))
            out.append(token)
        return out

    def commit(self, key: str, fed: list[int], after: int,
               hidden: torch.Tensor | None) -> None:
        row = self.rows.get(key)
        if row is None:
            return
        n = len(fed)
        if 0 < n <= len(row.trail) and row.fed[:n] == fed:
            row.state = row.trail[n - 1]
        else:  # every draft kept (one more token than was stepped), or no proposal
            _, row.state = self.draft.prefill(torch.tensor([fed]), row.state)
        row.seen += n
        row.trail, row.fed = [], []

    def drop(self, key: str) -> None:
        self.rows.pop(key, None)


@dataclass
class _MtpRow:
    """A request's MTP state: ``committed`` positions of it follow the kept tokens (draft
    positions past them are overwritten); ``g`` the head's output at the last one (None
    before any verify of this request), whose logits draft the token after the pending one."""

    state: State
    committed: int = 0
    g: torch.Tensor | None = None


class MtpProposer:
    """Drafts from the checkpoint's own MTP layers (vLLM's ``mtp``): after each verify the
    head's layer catches up on the kept positions (the served model's hidden state there and
    the token after it); a proposal takes the head's logits at the last one, then feeds its
    own output back. The head's logits (a read of the served model's head) are computed only
    when drafting, so a request whose drafts do not pay costs one layer a step. Its KV cache
    starts at the request's first verify (the prompt's hidden states are not kept)."""

    needs_hidden = True
    costly = True

    def __init__(self, head: DraftHead) -> None:
        self.head = head
        self.rows: dict[str, _MtpRow] = {}

    def propose(self, key: str, history: list[int], k: int) -> list[int]:
        row = self.rows.get(key)
        if row is None or row.g is None or k == 0:
            return []
        g, out = row.g, []
        while True:
            out.append(int(torch.argmax(self.head.logits(g[None])[0])))
            if len(out) == k:
                return out
            g = self.head.extend(row.state, g[None], [out[-1]])[-1]

    def commit(self, key: str, fed: list[int], after: int,
               hidden: torch.Tensor | None) -> None:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = _MtpRow(self.head.new_state())
        row.state.lengths[:] = row.committed  # the drafts' positions are dropped
        if hidden is None:
            row.g = None
            return
        row.g = self.head.extend(row.state, hidden, [*fed[1:], after])[-1]
        row.committed += len(fed)

    def drop(self, key: str) -> None:
        self.rows.pop(key, None)
