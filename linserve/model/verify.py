"""Verifying drafted tokens: T tokens per row in one call, and landing on any of them.

A verify feeds each row T tokens (its pending token and T − 1 drafts), returns the logits
at every position ``[B, T, V]`` and leaves the state after all T, with a :class:`Trail`: the
state after each earlier position, of the entries a truncation cannot roll back (recurrent
states, convolution windows, a sliding window's ring; a growing KV cache is cut back by its
length alone). :func:`keep` then puts each row at the position its accepted tokens end.

Every position's arithmetic is the decode step's, so a verify that kept j tokens leaves
exactly the state and logits of j plain steps. :func:`verify_by_steps` is the form any model
has (one step per position: exact, but the weights are read T times); a model with a native
verify (``decoder_verify``) reads them once for all T positions, its GEMMs over the B·T rows
(batch-invariant, so each row's product is the step's) and its mixers position by position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from linserve.model.state import KVEntry, State


@dataclass
class Trail:
    """``positions[t]``: after position t of a verify (t < T − 1), the tensors of
    :func:`rollback_tensors` order, each ``[B, ...]``."""

    positions: list[list[torch.Tensor]] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [B, T, d]: the final norm's output (MTP drafts)

    @property
    def tokens(self) -> int:
        """T, the tokens per row the verify fed."""
        return len(self.positions) + 1


def rollback_tensors(state: State) -> list[torch.Tensor]:
    """The state tensors a verify must keep per position: every entry's but a growing KV
    cache's (a sliding window's ring included: its slots are overwritten)."""
    out: list[torch.Tensor] = []
    for entry in state.entries():
        if isinstance(entry, KVEntry) and not entry.window:
            continue
        out += list(entry.tensors().values())
    return out


def verify_by_steps(step: Callable[[torch.Tensor, State], torch.Tensor], tokens: torch.Tensor,
                    state: State) -> tuple[torch.Tensor, Trail]:
    """tokens ``[B, T]`` fed one position at a time by ``step`` (which advances ``state``
    in place) -> logits ``[B, T, V]`` and the trail."""
    trail, logits = Trail(), []
    t_len = tokens.shape[1]
    for t in range(t_len):
        logits.append(step(tokens[:, t].contiguous(), state))
        if t + 1 < t_len:
            trail.positions.append([x.clone() for x in rollback_tensors(state)])
    return torch.stack(logits, 1), trail


def keep(state: State, trail: Trail, fed: torch.Tensor) -> None:
    """Put row b of ``state`` (as the verify left it) after the first ``fed[b]`` of its T
    tokens (1 ≤ fed ≤ T): the trail's tensors where fed < T, and the lengths."""
    t_len = trail.tokens
    live = rollback_tensors(state)
    for b, n in enumerate(fed.tolist()):
        if not 1 <= n <= t_len:
            raise ValueError(f"row {b} kept {n} of {t_len} verified tokens")
        if n < t_len:
            for dst, src in zip(live, trail.positions[n - 1], strict=True):
                dst[b].copy_(src[b])
    state.lengths -= t_len - fed
