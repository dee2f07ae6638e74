"""Vectorised sampling: every row of a batch has its own parameters and its own generator.

Logits are ``[B, V]``. Penalties, temperature, top-k, top-p and min-p are masks computed for
the whole batch at once; each sampled row then draws one uniform and inverts the CDF. A
seeded row draws from its own ``torch.Generator`` (so its output does not depend on its batch
mates); unseeded rows share one generator and draw in a single call. Rows with temperature
0 are greedy (argmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from linserve.model import kernels
from linserve.model.sampling_params import SamplingParams as SamplingParams  # re-exported


def make_generator(seed: int | None) -> torch.Generator:
    """A generator seeded with ``seed``, or from fresh entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def request_generator(seed: int | None) -> torch.Generator | None:
    """A request's own generator if it asked for a seed (its draws must not depend on its
    batch mates), else None: unseeded rows share one generator and draw in one call."""
    return None if seed is None else make_generator(seed)


_SHARED: list[torch.Generator] = []


def shared_generator() -> torch.Generator:
    """The generator of unseeded rows, seeded from fresh entropy once per process."""
    if not _SHARED:
        _SHARED.append(make_generator(None))
    return _SHARED[0]


def row_uniforms(generators: Sequence[torch.Generator | None], rows: Sequence[int]
                 ) -> torch.Tensor:
    """One uniform in [0, 1) for each of ``rows``: the unseeded rows' from one call to the
    shared generator, each seeded row's from its own generator."""
    gens = [generators[i] for i in rows]
    u = torch.rand(len(gens), generator=shared_generator())
    for j, g in enumerate(gens):
        if g is not None:
            u[j] = torch.rand(1, generator=g)
    return u


@dataclass
class BatchParams:
    """Column tensors ``[B]`` of every row's sampling parameters."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    bias: LogitBias | None = None

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> BatchParams:
        def col(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype)

        return cls(col("temperature"), col("top_k", torch.long), col("top_p"), col("min_p"),
                   col("repetition_penalty"), col("presence_penalty"), col("frequency_penalty"),
                   LogitBias.from_params(params))

    def select(self, idx: torch.Tensor) -> BatchParams:
        """These rows' columns (the logit bias is applied before rows are selected)."""
        cols = (getattr(self, f).index_select(0, idx) for f in COLUMNS)
        return BatchParams(*cols)

    @cached_property
    def hot(self) -> list[bool]:
        """Which rows sample (temperature > 0) rather than take the argmax."""
        return (self.temperature > 0).tolist()

    @cached_property
    def sorting(self) -> torch.Tensor:
        """Which rows use top-k or top-p ``[B]`` bool (the native sampler handles neither)."""
        return (self.top_k > 0) | (self.top_p < 1)


COLUMNS = ("temperature", "top_k", "top_p", "min_p", "repetition", "presence", "frequency")


@dataclass(frozen=True)
class LogitBias:
    """OpenAI's ``logit_bias`` for a batch, as sparse (row, token, bias) triples. A bias of
    -100 bans the token outright (-inf), as OpenAI documents it; others are added."""

    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> LogitBias | None:
        triples = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
        if not triples:
            return None
        rows, ids, values = zip(*triples, strict=True)
        vals = torch.tensor(values, dtype=torch.float32)
        vals = torch.where(vals <= -100, torch.tensor(float("-inf")), vals)
        return cls(torch.tensor(rows), torch.tensor(ids), vals)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """New logits ``[B, V]`` with the biases added."""
        return logits.float().index_put((self.rows, self.ids), self.values, accumulate=True)


@dataclass(frozen=True)
class TokenMask:
    """Rows restricted to some tokens (structured outputs), as packed bits: ``bits
    [B, ceil(V/32)]`` int32 has bit ``i % 32`` of word ``i // 32`` set where token i may come
    next; an unconstrained row is all ones (-1). ``rows [k]``: the constrained rows."""

    bits: torch.Tensor
    rows: torch.Tensor

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """The constrained rows' masks unpacked: ``[k, V]`` bool."""
        packed = self.bits.index_select(0, self.rows)
        shifts = torch.arange(32, dtype=torch.int32)
        return ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """New logits ``[B, V]`` with every disallowed token of the masked rows at -inf."""
        logits = logits.float()
        allowed = self.allowed(logits.shape[-1])
        masked = logits.index_select(0, self.rows).masked_fill(~allowed, float("-inf"))
        return logits.index_copy(0, self.rows, masked)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                    bp: BatchParams) -> torch.Tensor:
    """OpenAI presence/frequency penalties on generated-token ``counts [B, V]``, and the CTRL
    repetition penalty on every ``seen [B, V]`` token (prompt or output). Returns new logits."""
    logits = logits - bp.frequency[:, None] * counts - bp.presence[:, None] * (counts > 0)
    # A penalty that underflows fp32 (a JSON 1e-300) would divide by zero: +inf, then NaN.
    rep = bp.repetition.clamp(min=1e-6)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    return torch.where(seen, penalised, logits)


def top_k_mask(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """True where a token is outside its row's top k (k ≤ 0: keep all). ``[B, V]`` bool."""
    kmax = int(k.max())
    if kmax <= 0:
        return torch.zeros_like(logits, dtype=torch.bool)
    kk = k.clamp(min=1, max=logits.shape[-1])
    top = torch.topk(logits, min(kmax, logits.shape[-1]), dim=-1).values
    thresh = top.gather(-1, (kk.clamp(max=top.shape[-1]) - 1)[:, None])
    return (logits < thresh) & (k[:, None] > 0)


def top_p_mask(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """True outside the smallest set of tokens whose mass reaches p (the top token is always
    kept). probs ``[B, V]``, p ``[B]``."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
    drop_sorted = before >= p[:, None]
    drop_sorted[:, 0] = False  # even when p rounds to 0 in fp32 (a JSON 1e-323)
    return torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """True where a token's probability is below min_p × the row's top probability."""
    return probs < min_p[:, None] * probs.amax(-1, keepdim=True)


def sampling_probs(logits: torch.Tensor, bp: BatchParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied: the distribution to draw from ``[B, V]``."""
    temp = bp.temperature.clamp(min=1e-5)[:, None]
    logits = logits / temp
    logits = logits.masked_fill(top_k_mask(logits, bp.top_k), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    drop = torch.zeros_like(probs, dtype=torch.bool)
    if bool((bp.top_p < 1.0).any()):
        drop |= top_p_mask(probs, bp.top_p)
    if bool((bp.min_p > 0.0).any()):
        drop |= min_p_mask(probs, bp.min_p)
    return probs.masked_fill(drop, 0.0)


def _grammar_over_bias(logits: torch.Tensor, raw: torch.Tensor, mask: TokenMask
                       ) -> torch.Tensor:
    """A constrained row whose ``logit_bias`` bans every token its grammar allows draws from
    the grammar alone (its raw logits): the mask is a hard constraint, a bias is not."""
    allowed = mask.allowed(logits.shape[-1])
    masked = logits.index_select(0, mask.rows).masked_fill(~allowed, float("-inf"))
    dead = ~torch.isfinite(masked).any(-1)
    if not bool(dead.any()):
        return logits
    rows = mask.rows[dead]
    return logits.index_copy(0, rows, raw.float().index_select(0, rows))


def _sample_native(logits: torch.Tensor, bp: BatchParams,
                   generators: Sequence[torch.Generator | None], mask: TokenMask | None
                   ) -> torch.Tensor:
    """Temperature / min-p / greedy rows in one native pass per row (``sampling.cpp``), the
    token mask read in the same pass. Each sampled row draws one uniform as the eager path
    does (:func:`row_uniforms`); greedy rows ignore theirs."""
    hot = [i for i, h in enumerate(bp.hot) if h]
    u = torch.zeros(len(generators))
    if hot:
        u[hot] = row_uniforms(generators, hot)
    return torch.ops.linserve.sample_rows(logits.float(), bp.temperature, bp.min_p, u,
                                          None if mask is None else mask.bits)


def _sample_eager(logits: torch.Tensor, bp: BatchParams,
                  generators: Sequence[torch.Generator | None], mask: TokenMask | None
                  ) -> torch.Tensor:
    """The reference path (sorting for top-k and top-p): masks, softmax and an inverse-CDF
    draw with each sampled row's uniform. Every operation is row-wise, so a row's token does
    not depend on the other rows of the batch."""
    if mask is not None:
        logits = mask.apply(logits)
    tokens = logits.argmax(-1)
    hot = (bp.temperature > 0).nonzero().flatten()
    if hot.numel() == 0:
        return tokens
    probs = sampling_probs(logits.index_select(0, hot), bp.select(hot))
    u = row_uniforms(generators, hot.tolist())
    cdf = probs.cumsum(-1)
    # side="right": the first token whose cumulative mass exceeds u·total, so u = 0 never
    # lands on a leading token of zero probability.
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    tokens[hot] = drawn.clamp(max=logits.shape[-1] - 1)
    return tokens


def _rows(logits: torch.Tensor, bp: BatchParams, generators: Sequence[torch.Generator | None],
          mask: TokenMask | None, rows: list[int]
          ) -> tuple[torch.Tensor, BatchParams, list[torch.Generator | None], TokenMask | None]:
    """The sub-batch of ``rows``: logits, parameters, generators and token mask."""
    idx = torch.tensor(rows)
    sub_mask = None
    if mask is not None:
        constrained = torch.isin(idx, mask.rows).nonzero().flatten()
        sub_mask = TokenMask(mask.bits.index_select(0, idx), constrained)
    return (logits.index_select(0, idx), bp.select(idx), [generators[i] for i in rows],
            sub_mask)


def sample(logits: torch.Tensor, bp: BatchParams,
           generators: Sequence[torch.Generator | None],
           counts: torch.Tensor | None = None, seen: torch.Tensor | None = None,
           native: bool = True, mask: TokenMask | None = None) -> torch.Tensor:
    """Next token per row ``[B]`` (long). ``generators[i]`` serves row i only; ``mask``
    restricts some rows to allowed tokens (applied last, so no bias can lift it).

    Each row takes its own path, whatever its batch mates do: rows without top-k or top-p
    go through the native sampler when the kernels are loaded, the others (and every row
    with ``native=False``) through the eager sorting path. The two paths sum the CDF in
    different orders and may draw different tokens at a boundary, so choosing the path per
    batch would make a seeded row's text depend on its neighbours.
    """
    raw = logits
    if bp.bias is not None:
        logits = bp.bias.apply(logits)
    if counts is not None and seen is not None:
        logits = apply_penalties(logits, counts, seen, bp)
    if mask is not None and bp.bias is not None:
        logits = _grammar_over_bias(logits, raw, mask)
    if not (native and kernels.available()):
        return _sample_eager(logits, bp, generators, mask)
    sorting = bp.sorting.tolist()
    if not any(sorting):
        return _sample_native(logits, bp, generators, mask)
    if all(sorting):
        return _sample_eager(logits, bp, generators, mask)
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    for path, want in ((_sample_native, False), (_sample_eager, True)):
        rows = [i for i, s in enumerate(sorting) if s == want]
        tokens[rows] = path(*_rows(logits, bp, generators, mask, rows))
    return tokens


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the raw model: chosen ``[B]``, and the top n ``([B, n], [B, n])``
    as (values, token ids)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, max(n, 1), dim=-1)
    return logp.gather(-1, chosen[:, None]).squeeze(-1), top.values, top.indices
