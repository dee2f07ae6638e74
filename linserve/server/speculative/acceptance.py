"""How many tokens to draft: each request's recent acceptance against what a verify costs.

A verify of T tokens per row costs more than a plain step (``bench.spec_decode`` measures
T(k+1) ÷ T(1)); it pays only where enough drafts are kept. :class:`CostModel` keeps the
measured seconds of plain steps and of verifies by the tokens they ran (seeded at start by
timing both forms); :class:`DraftBudget` keeps each request's acceptance rate α (a decaying
count of kept over tried drafts) and picks the draft length k that maximises the expected
tokens per second, E = (1 − α^(k+1)) / (1 − α) per verify, or 0 (a plain step) where no k
beats plain decoding. A request at k = 0 is probed with one draft every ``PROBE_EVERY`` steps
so that a text that turns repetitive is noticed.
"""

from __future__ import annotations

from collections.abc import Callable

DECAY = 0.7  # weight of the past in a request's acceptance counts
PROBE_EVERY = 8
MARGIN = 1.05  # a verify must promise this much more than plain decoding


class CostModel:
    """Seconds of the model's calls by tokens run: plain steps by batch rows, verifies (and
    replays) by total tokens; exponentially averaged."""

    def __init__(self) -> None:
        self.step: dict[int, float] = {}
        self.verify: dict[int, float] = {}
        self.draft_token = 0.0  # a draft model's step, per token

    @staticmethod
    def _note(table: dict[int, float], n: int, seconds: float) -> None:
        old = table.get(n)
        table[n] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def note_step(self, rows: int, seconds: float) -> None:
        self._note(self.step, rows, seconds)

    def note_verify(self, tokens: int, seconds: float) -> None:
        self._note(self.verify, tokens, seconds)

    def note_draft(self, tokens: int, seconds: float) -> None:
        if tokens:
            per = seconds / tokens
            self.draft_token = per if not self.draft_token else 0.8 * self.draft_token + 0.2 * per

    @staticmethod
    def _estimate(table: dict[int, float], n: int) -> float | None:
        """The nearest measured size's seconds, scaled up linearly past it."""
        if not table:
            return None
        if n in table:
            return table[n]
        below = [m for m in table if m < n]
        m = max(below) if below else min(table)
        return table[m] * max(1.0, n / m)

    def step_seconds(self, rows: int) -> float | None:
        return self._estimate(self.step, rows)

    def verify_seconds(self, tokens: int) -> float | None:
        return self._estimate(self.verify, tokens)


class DraftBudget:
    """Per request: acceptance counts and the draft length they earn (see module doc)."""

    def __init__(self, k_max: int, costs: CostModel) -> None:
        self.k_max, self.costs = k_max, costs
        self.kept: dict[str, float] = {}
        self.tried: dict[str, float] = {}
        self.idle: dict[str, int] = {}

    def alpha(self, key: str) -> float:
        """The request's acceptance rate (a prior of 1/2 before any draft)."""
        return (self.kept.get(key, 1.0)) / (self.tried.get(key, 2.0))

    def record(self, key: str, drafted: int, kept: int) -> None:
        """``kept`` of ``drafted`` drafts were accepted (tried: up to the first refusal)."""
        if drafted == 0:
            return
        tried = kept + (1 if kept < drafted else 0)
        self.kept[key] = DECAY * self.kept.get(key, 1.0) + kept
        self.tried[key] = DECAY * self.tried.get(key, 2.0) + tried

    def drop(self, key: str) -> None:
        for table in (self.kept, self.tried, self.idle):
            table.pop(key, None)

    def length(self, key: str, limit: int) -> int:
        """The draft length for the request's next verify (at most ``limit``)."""
        k_max = min(self.k_max, limit)
        if k_max <= 0:
            return 0
        k = best_length(self.alpha(key), k_max, self._relative_cost)
        if k == 0:
            self.idle[key] = self.idle.get(key, 0) + 1
            if self.idle[key] >= PROBE_EVERY:
                self.idle[key], k = 0, 1
        return k

    def _relative_cost(self, k: int) -> float:
        """A verify of k drafts (k + 1 tokens, and k draft steps) over a plain step, alone."""
        step = self.costs.step_seconds(1)
        verify = self.costs.verify_seconds(k + 1)
        if not step or verify is None:
            return 1.0 + 0.1 * k  # not measured yet: optimistic, so that it is measured
        return (verify + k * self.costs.draft_token) / step


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify of k drafts yields when each is kept with probability α."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(alpha: float, k_max: int, relative_cost: Callable[[int], float]) -> int:
    """The k in 0..k_max with the most tokens per plain step's time (0 unless some k beats
    plain decoding by :data:`MARGIN`)."""
    best, best_rate = 0, MARGIN
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k) / relative_cost(k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
