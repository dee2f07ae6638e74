"""How many tokens to draft: each request's recent acceptance against what a verify costs.

A verify of T tokens per row costs more than a plain step (``bench.spec_decode`` measures
T(k+1) ÷ T(1)); it pays only where enough drafts are kept. :class:`CostModel` keeps the
measured seconds of plain steps and of verifies by the tokens they ran (seeded at start by
timing both forms); :class:`DraftBudget` keeps each request's acceptance by draft position,
a_i = P(draft i kept | the drafts before it kept) (decaying counts, starting from every
request's rates), and picks the draft length k that maximises the expected tokens per
second, E = 1 + a_1 + a_1 a_2 + ... + a_1 ⋯ a_k per verify, or 0 (a plain step) where no k
beats plain decoding. Per position, because a draft's chance falls with its distance: an MTP
layer fed its own output kept its first draft 92% of the time and its third 31%, so
one rate for all positions over-drafts. Every ``PROBE_EVERY`` verifies a request drafts one
more than its best length (one draft at k = 0), so that a text that turns repetitive, or a
position refused by chance at first, is noticed.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

DECAY = 0.8  # weight of the past in a request's acceptance counts
GLOBAL_DECAY = 0.99  # ... and in the counts of every request together
PRIOR_TRIES = 2.0  # a request's counts start as this many tries at everyone's rates
PROBE_EVERY = 8
MARGIN = 1.05  # a verify must promise this much more than plain decoding
WINDOW = 9  # timings kept per size


class CostModel:
    """Seconds of the model's calls by tokens run: plain steps by batch rows, verifies by
    total tokens, and a draft token. Each size keeps its last :data:`WINDOW` timings and is
    read as their median, so that one slow call (a page fault, a neighbour's burst, the first
    call of a shape) does not stick to a size seldom run again: with one exponential average
    a size timed once at 8x its cost was never chosen again, so never timed again.
    A verify size never timed is read off the line through the nearest timed sizes."""

    def __init__(self) -> None:
        self.step: dict[int, deque[float]] = {}
        self.verify: dict[int, deque[float]] = {}
        self.drafts: deque[float] = deque(maxlen=WINDOW)  # seconds per draft token

    @staticmethod
    def _note(table: dict[int, deque[float]], n: int, seconds: float) -> None:
        table.setdefault(n, deque(maxlen=WINDOW)).append(seconds)

    def note_step(self, rows: int, seconds: float) -> None:
        self._note(self.step, rows, seconds)

    def note_verify(self, tokens: int, seconds: float) -> None:
        self._note(self.verify, tokens, seconds)

    def note_draft(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.drafts.append(seconds / tokens)

    @property
    def draft_token(self) -> float:
        """A draft model's (or MTP layer's) seconds per drafted token; 0 before any."""
        return statistics.median(self.drafts) if self.drafts else 0.0

    @staticmethod
    def _estimate(table: dict[int, deque[float]], n: int) -> float | None:
        """Size ``n``'s median; else the line through the two nearest timed sizes (never
        below the smaller one's), or a single timed size scaled linearly."""
        if not table:
            return None
        if n in table:
            return statistics.median(table[n])
        sizes = sorted(table, key=lambda m: (abs(m - n), m))[:2]
        if len(sizes) == 1:
            m = sizes[0]
            return statistics.median(table[m]) * max(1.0, n / m)
        m0, m1 = sorted(sizes)
        t0, t1 = statistics.median(table[m0]), statistics.median(table[m1])
        slope = max(0.0, (t1 - t0) / (m1 - m0))
        return max(t0, t0 + slope * (n - m0))

    def step_seconds(self, rows: int) -> float | None:
        return self._estimate(self.step, rows)

    def verify_seconds(self, tokens: int) -> float | None:
        return self._estimate(self.verify, tokens)


class PositionRates:
    """Decaying counts of drafts kept and tried at each draft position, and the conditional
    rate a_i = P(draft i kept | drafts before it kept) they give (``prior`` before any)."""

    def __init__(self, k_max: int, decay: float) -> None:
        self.decay = decay
        self.kept = [0.0] * k_max
        self.tried = [0.0] * k_max

    def record(self, drafted: int, kept: int) -> None:
        """``kept`` of ``drafted`` drafts accepted: positions before ``kept`` were kept, the
        one at ``kept`` (if any) refused, the rest never reached."""
        for i in range(min(drafted, kept + 1)):
            self.kept[i] = self.decay * self.kept[i] + (1.0 if i < kept else 0.0)
            self.tried[i] = self.decay * self.tried[i] + 1.0

    def rates(self, prior: list[float] | None, weight: float) -> list[float]:
        """Each position's rate, its counts shrunk toward ``prior`` by ``weight`` tries.
        Without a prior, position i's is position i − 1's rate (1/2 for the first): a
        position seldom tried is expected to keep drafts as the one before it does, so that
        it gets tried (from a prior of 1/2, a length that never reached the second position
        never learnt that it paid: 32 second drafts in 99 verifies)."""
        out: list[float] = []
        for i, (k, t) in enumerate(zip(self.kept, self.tried, strict=True)):
            p = prior[i] if prior is not None else (out[-1] if out else 0.5)
            out.append((k + weight * p) / (t + weight))
        return out


class DraftBudget:
    """Per request: acceptance by draft position and the draft length it earns (see module
    doc). A request's rates start from the rates of every request so far."""

    def __init__(self, k_max: int, costs: CostModel, plain_is_verify: bool = False) -> None:
        """``plain_is_verify``: a request drafting nothing still runs a verify of one token
        (an MTP layer needs the served model's hidden state), so that is what drafts must
        beat, not a plain step."""
        self.k_max, self.costs, self.plain_is_verify = k_max, costs, plain_is_verify
        self.everyone = PositionRates(k_max, GLOBAL_DECAY)
        self.per_request: dict[str, PositionRates] = {}
        self.idle: dict[str, int] = {}

    def rates(self, key: str) -> list[float]:
        """The request's conditional acceptance by position (everyone's, where it has drafted
        little; 1/2 before any draft anywhere)."""
        prior = self.everyone.rates(None, PRIOR_TRIES)
        own = self.per_request.get(key)
        return prior if own is None else own.rates(prior, PRIOR_TRIES)

    def record(self, key: str, drafted: int, kept: int) -> None:
        """``kept`` of ``drafted`` drafts were accepted."""
        if drafted == 0:
            return
        self.everyone.record(drafted, kept)
        own = self.per_request.setdefault(key, PositionRates(self.k_max, DECAY))
        own.record(drafted, kept)

    def drop(self, key: str) -> None:
        self.per_request.pop(key, None)
        self.idle.pop(key, None)

    def length(self, key: str, limit: int) -> int:
        """The draft length for the request's next verify (at most ``limit``): the best by
        the rates, one more every :data:`PROBE_EVERY` verifies (below ``limit``), so that
        the position past the best is tried now and then. Without it a position whose
        first one or two drafts were refused stayed below its worth for good: an MTP
        layer's second draft, kept 77% of the time, was tried 21 times in 116 verifies
       ."""
        k_max = min(self.k_max, limit)
        if k_max <= 0:
            return 0
        k = best_length(self.rates(key)[:k_max], self._relative_cost)
        if k < k_max:
            self.idle[key] = self.idle.get(key, 0) + 1
            if self.idle[key] >= PROBE_EVERY:
                self.idle[key], k = 0, k + 1
        return k

    def _relative_cost(self, k: int) -> float:
        """A verify of k drafts (k + 1 tokens, and k draft steps) over drafting none, alone."""
        step = (self.costs.verify_seconds(1) if self.plain_is_verify
                else self.costs.step_seconds(1))
        verify = self.costs.verify_seconds(k + 1)
        if not step or verify is None:
            return 1.0 + 0.1 * k  # not measured yet: optimistic, so that it is measured
        return (verify + k * self.costs.draft_token) / step


def expected_tokens(rates: list[float]) -> float:
    """Tokens one verify of ``len(rates)`` drafts yields when draft i is kept with
    probability ``rates[i]`` given the drafts before it were: 1 + a_1 + a_1 a_2 + ..."""
    total, reach = 1.0, 1.0
    for a in rates:
        reach *= a
        total += reach
    return total


def best_length(rates: list[float], relative_cost: Callable[[int], float]) -> int:
    """The k in 0..len(rates) with the most tokens per plain step's time (0 unless some k
    beats plain decoding by :data:`MARGIN`)."""
    best, best_rate = 0, MARGIN
    for k in range(1, len(rates) + 1):
        rate = expected_tokens(rates[:k]) / relative_cost(k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
