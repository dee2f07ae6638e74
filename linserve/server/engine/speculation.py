"""One speculative decode iteration: draft, verify in one pass, keep what plain decoding keeps.

Each running row feeds its pending token and its drafts d1..dk (:mod:`linserve.server.
speculative.proposers`) in one :meth:`~linserve.model.interface.ServedModel.verify` of the
slot pool's rows, in place: T = 1 + the longest draft tokens per row (shorter rows padded),
every position's logits as a plain step computes them. Position by position, each row then
samples from those logits exactly as a plain step would (the same penalties, bias, grammar
mask and seeded draw at that position): the row goes on while the sampled token equals its
next draft. With greedy drafts this is Leviathan et al.'s rejection sampling, and a seeded
request samples the very tokens it samples without speculation. Finally
:meth:`~linserve.model.interface.ServedModel.keep` puts each row's state after the tokens it
kept, from the verify's trail (a KV cache by its length alone).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from linserve.model.inputs import is_virtual
from linserve.model.interface import CheckpointError, ServedModel
from linserve.server import metrics
from linserve.server.speculative.acceptance import CostModel, DraftBudget
from linserve.server.speculative.config import SpeculativeConfig
from linserve.server.speculative.proposers import (
    DraftModelProposer,
    MtpProposer,
    NgramProposer,
    Proposer,
)

if TYPE_CHECKING:
    from linserve.server.engine.pool import SlotPool
    from linserve.server.engine.row_sampler import RowSampler
    from linserve.server.engine.sequence import Sequence

log = logging.getLogger("linserve.engine")


@dataclass
class Row:
    """One row of a verify: its slot, the tokens it feeds (pending token, then drafts) and
    how many positions were sampled (the tokens its kept state consumes)."""

    seq: Sequence
    slot: int
    feed: list[int]
    fed: int = 0


def build_proposer(config: SpeculativeConfig, model: ServedModel, draft: ServedModel | None
                   ) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    if config.method == "mtp":
        head = model.draft_head()
        if head is None:
            raise CheckpointError("the checkpoint has no MTP layers (mtp.* tensors)")
        return MtpProposer(head)
    assert draft is not None, "draft_model needs its model loaded"
    return DraftModelProposer(draft)


class Speculator:
    """The engine's speculative decoding (``--speculative-config``): verifies drafts for the
    live rows of ``pool`` (the running sequences, in slot order) on ``model``, sampling
    each position through ``sampler`` as a plain step does."""

    def __init__(self, model: ServedModel, pool: SlotPool, sampler: RowSampler,
                 config: SpeculativeConfig, draft: ServedModel | None = None) -> None:
        self.model, self.pool, self.sampler, self.config = model, pool, sampler, config
        self.proposer = build_proposer(config, model, draft)
        self.costs = CostModel()
        self.budget = DraftBudget(config.num_speculative_tokens, self.costs,
                                  plain_is_verify=self.proposer.needs_hidden)
        self.drafted = self.accepted = self.verifies = 0  # since start
        self.kept_at = [0] * config.num_speculative_tokens  # drafts kept, by position
        self.tried_at = [0] * config.num_speculative_tokens  # drafts verified, by position

    def calibrate(self, rounds: int = 3) -> None:
        """Seed the cost model: a plain step and verifies of 1..k+1 tokens, timed alone, in
        ``rounds`` interleaved rounds after one untimed (the cost model reads medians)."""
        model = self.model
        _, state = model.prefill(torch.zeros(1, 16, dtype=torch.long))
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            model.step(torch.zeros(1, dtype=torch.long), state.copy())
            if r:
                self.costs.note_step(1, time.perf_counter() - t0)
            for t in range(1, self.config.num_speculative_tokens + 2):
                t0 = time.perf_counter()
                model.verify(torch.zeros(1, t, dtype=torch.long), state.copy())
                if r:
                    self.costs.note_verify(t, time.perf_counter() - t0)

    def forget(self, seq: Sequence) -> None:
        """The request left: drop its draft state, and log its acceptance."""
        key = seq.req.request_id
        if seq.spec_drafted:
            log.info(json.dumps({"event": "speculation", "id": key,
                                 "drafted": seq.spec_drafted, "accepted": seq.spec_accepted,
                                 "rate": round(seq.spec_accepted / seq.spec_drafted, 3)}))
        self.proposer.drop(key)
        self.budget.drop(key)

    def note_plain_step(self, rows: int, seconds: float) -> None:
        self.costs.note_step(rows, seconds)

    def _limit(self, seq: Sequence) -> int:
        """Drafts worth verifying: none past max_tokens or the model's context."""
        room = seq.params.max_tokens - len(seq.generated)
        ctx = self.model.info.context_limit
        if ctx is not None:
            room = min(room, ctx - seq.total_tokens)
        return room - 1

    def _drafts(self, seqs: list[Sequence]) -> list[list[int]]:
        t0, drafted = time.perf_counter(), 0
        out = []
        for seq in seqs:
            key = seq.req.request_id
            limit = self._limit(seq)
            k = (self.budget.length(key, limit) if self.config.adaptive
                 else max(0, min(self.config.num_speculative_tokens, limit)))
            history = seq.req.input_ids + seq.generated
            drafts = self.proposer.propose(key, history, k) if k else []
            # an item's virtual ids are prompt positions, never a token to draft
            cut = next((i for i, t in enumerate(drafts) if is_virtual(t)), len(drafts))
            out.append(drafts[:cut])
            drafted += len(out[-1])
        if self.proposer.costly:
            self.costs.note_draft(drafted, time.perf_counter() - t0)
        return out

    def step(self, seqs: list[Sequence]) -> bool:
        """Run one speculative iteration over the running rows ``seqs`` (``seqs[i]`` in pool
        slot i); False (nothing done) when the batch is too large or no row has a draft, so
        that the engine steps plainly."""
        if len(seqs) > self.config.max_batch:
            return False
        drafts = self._drafts(seqs)
        if not any(drafts) and not self.proposer.needs_hidden:
            return False
        width = 1 + max(len(d) for d in drafts)
        rows = [Row(seq, i, [seq.last_token or 0, *d]) for i, (seq, d) in
                enumerate(zip(seqs, drafts, strict=True))]
        tokens = torch.tensor([r.feed + [0] * (width - len(r.feed)) for r in rows])
        self.pool.reserve_step(width)
        view = self.pool.view()
        t0 = time.perf_counter()
        logits, trail = self.model.verify(tokens, view)
        self.costs.note_verify(tokens.numel(), time.perf_counter() - t0)
        self.verifies += 1
        self._accept(rows, list(logits))
        self.model.keep(view, trail, torch.tensor([r.fed for r in rows]))
        for b, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
            hidden = None if trail.hidden is None else trail.hidden[b, : row.fed]
            self._record(row, len(draft), hidden)
        return True

    def _accept(self, rows: list[Row], logits: list[torch.Tensor]) -> None:
        """Sample position by position as plain decoding would; a row goes on while its
        sample equals its next draft and it has not finished."""
        active = list(range(len(rows)))
        pos = 0
        while active:
            seqs = [rows[r].seq for r in active]
            idx = torch.tensor([rows[r].slot for r in active])
            self.sampler.sample_slots(seqs, torch.stack([logits[r][pos] for r in active]), idx)
            still = []
            for r in active:
                row = rows[r]
                row.fed = pos + 1
                seq = row.seq
                if (seq.finish_reason is None and pos + 1 < len(row.feed)
                        and seq.generated[-1] == row.feed[pos + 1]):
                    still.append(r)
            active, pos = still, pos + 1

    def _record(self, row: Row, drafted: int, hidden: torch.Tensor | None) -> None:
        key = row.seq.req.request_id
        kept = row.fed - 1
        self.proposer.commit(key, row.feed[: row.fed], row.seq.last_token or 0, hidden)
        self.budget.record(key, drafted, kept)
        self.drafted += drafted
        self.accepted += kept
        row.seq.spec_drafted += drafted
        row.seq.spec_accepted += kept
        if drafted:
            metrics.SPEC_DRAFT_TOKENS.inc(drafted)
            metrics.SPEC_ACCEPTED_TOKENS.inc(kept)
            for pos in range(kept):
                metrics.SPEC_ACCEPTED_BY_POSITION.labels(position=str(pos)).inc()
                self.kept_at[pos] += 1
            for pos in range(drafted):
                self.tried_at[pos] += 1
