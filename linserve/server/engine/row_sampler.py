"""Sampling one token for each of a set of running rows: the batch's parameters, grammar
masks, penalties from the slot pool's counts, logprobs, and each sequence's bookkeeping.
The engine's plain step and the speculator's verify positions both sample through it."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from linserve.model.sampling import BatchParams, sample, top_logprobs
from linserve.server import metrics
from linserve.server.engine.pool import SlotPool
from linserve.server.engine.sequence import Sequence, logprob_entries
from linserve.server.engine.types import TokenLogprob
from linserve.server.grammar.engine_side import EngineGrammars, MaskResult, matcher_error

log = logging.getLogger("linserve.engine")


class RowSampler:
    """Samples rows of ``pool`` under their requests' parameters and ``grammars``."""

    def __init__(self, pool: SlotPool, grammars: EngineGrammars) -> None:
        self.pool, self.grammars = pool, grammars
        # rows' request ids -> their BatchParams and whether any uses penalties
        self._bp_cache: dict[tuple[str, ...], tuple[BatchParams, bool]] = {}

    def forget(self) -> None:
        """Drop the cached batch parameters (after a failure, or rows sampled alone)."""
        self._bp_cache.clear()

    def batch_params(self, seqs: list[Sequence]) -> tuple[BatchParams, bool]:
        """Column tensors of the rows' parameters, and whether any row uses penalties.
        Built once per set of rows (the running batch, or a speculative verify's rows still
        sampling at a position), not every step."""
        key = tuple(s.req.request_id for s in seqs)
        hit = self._bp_cache.get(key)
        if hit is not None:
            return hit
        params = [s.params for s in seqs]
        use_pen = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                      for p in params)
        if len(self._bp_cache) >= 16:  # batches come and go: keep the few in use
            self._bp_cache.clear()
        self._bp_cache[key] = (BatchParams.from_params(params), use_pen)
        return self._bp_cache[key]

    def sample_slots(self, seqs: list[Sequence], logits: torch.Tensor, slots: torch.Tensor
                     ) -> None:
        """:meth:`sample` for running rows in pool ``slots`` [rows] (a speculative verify's
        position; ``logits`` [rows, V]), counting their tokens for the penalties there (the
        counts are gathered only when a row uses penalties: a [rows, V] copy a position)."""
        _, use_pen = self.batch_params(seqs)
        pool = self.pool
        counts, seen = (pool.counts[slots], pool.seen[slots]) if use_pen else (
            pool.counts[:0], pool.seen[:0])
        self.sample(seqs, logits, counts, seen, slots=slots)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, counts: torch.Tensor,
               seen: torch.Tensor, masks: Future[MaskResult] | None = None,
               slots: torch.Tensor | None = None, pooled: bool = False) -> int:
        """Sample one token per row from ``logits`` [rows, V] and record it on each
        sequence; returns row 0's token. ``counts`` / ``seen`` [rows, V]: the rows' penalty
        bookkeeping; ``masks``: the rows' grammar masks, if already started; ``slots``: the
        rows' pool slots where they are not the whole running batch; ``pooled``: the rows are
        the pool's live rows [0, n), in order. A row whose bookkeeping raises is failed
        alone."""
        params = [s.params for s in seqs]
        bp, use_pen = self.batch_params(seqs)
        mask, dead = (masks.result() if masks is not None
                      else self.grammars.masks([s.matcher for s in seqs]))
        for i in dead:
            seqs[i].fail(f"the grammar allows no next token: {matcher_error(seqs[i].matcher)}")
        tokens = sample(logits, bp, [s.generator for s in seqs],
                        counts if use_pen else None, seen if use_pen else None, mask=mask)
        n_lp = max((p.logprobs or 0) for p in params)
        entries: list[TokenLogprob | None] = [None] * len(seqs)
        if any(p.logprobs is not None for p in params):
            chosen, values, ids = top_logprobs(logits, tokens, n_lp)
            packed = logprob_entries(chosen, values, ids, tokens, n_lp)
            entries = [e if p.logprobs is not None else None
                       for e, p in zip(packed, params, strict=True)]
        if use_pen and pooled:  # only penalised rows read the counts
            self.pool.record(tokens)
        elif use_pen and slots is not None:
            self.pool.record(tokens, slots)
        for seq, tok, entry in zip(seqs, tokens.tolist(), entries, strict=True):
            if seq.finish_reason == "error":
                continue
            try:
                seq.add_token(tok, entry)
            except Exception as exc:
                log.exception("request %s failed on a sampled token", seq.req.request_id)
                seq.fail(f"internal error: {exc}")
        metrics.GENERATION_TOKENS.inc(len(seqs))
        return int(tokens[0])
