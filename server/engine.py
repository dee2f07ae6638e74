"""The engine: one thread owns the model and runs the continuous-batching loop.

Each iteration it (1) takes new requests and cancellations from its inbox, (2) prefills
waiting prompts in chunks under a token budget, and (3) runs ONE batched ``step`` over every
running sequence, samples all rows at once, and hands the deltas to the event loop in a
single thread-safe call. HTTP handlers never touch tensors; they talk to :class:`EngineClient`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from model.sampling import BatchParams, sample, top_logprobs
from model.state import State
from model.tokenizer import Tokenizer
from model.transformer import LanguageModel
from server import metrics
from server.pool import SlotPool
from server.sequence import Sequence, logprob_entries
from server.types import GenerationRequest, Output, TokenLogprob

log = logging.getLogger("linserve.engine")
Sink = Callable[[Output], None]
Deliver = Callable[[list[tuple[Sink, Output]]], None]


class Overloaded(Exception):
    """The engine's queue is full; the caller should answer 429."""


@dataclass
class EngineLimits:
    max_running: int = 64
    max_waiting: int = 256
    prefill_chunk: int = 512
    step_token_budget: int = 512


class Engine:
    """Continuous-batching scheduler. Public methods are thread-safe; the loop runs in
    :meth:`run` on its own thread."""

    def __init__(self, model: LanguageModel, tokenizer: Tokenizer, limits: EngineLimits,
                 deliver: Deliver) -> None:
        self.model = model
        self.tok = tokenizer
        self.limits = limits
        self.deliver = deliver
        self.pool = SlotPool(model, limits.max_running)
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] lives in pool slot i
        self.sinks: dict[str, Sink] = {}
        self._inflight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._outbox: list[tuple[Sink, Output]] = []
        self._bp_cache: tuple[tuple[str, ...], BatchParams, bool] | None = None
        self.steps = 0

    # ---- thread-safe API -------------------------------------------------------------
    def submit(self, req: GenerationRequest, sink: Sink) -> None:
        """Queue a request; raises :class:`Overloaded` past running + waiting capacity."""
        with self._lock:
            if self._inflight >= self.limits.max_running + self.limits.max_waiting:
                raise Overloaded
            self._inflight += 1
        self.inbox.put(("submit", (req, sink)))

    def cancel(self, request_id: str, sent_tokens: int | None = None) -> None:
        """Cancel at the next iteration. ``sent_tokens``: how many generated tokens the client
        received (the session then ends exactly there)."""
        self.inbox.put(("cancel", (request_id, sent_tokens)))

    def finish_all(self) -> None:
        """End every request now, as if it hit max_tokens (used when shutting down)."""
        self.inbox.put(("finish_all", None))

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))

    @property
    def inflight(self) -> int:
        return self._inflight

    # ---- the loop --------------------------------------------------------------------
    def run(self) -> None:
        log.info("engine loop started")
        while not self._stop.is_set():
            try:
                self.iterate()
            except Exception:  # never let one bad batch kill the server
                log.exception("engine iteration failed; failing the affected requests")
                self._fail_all("internal engine error")
        log.info("engine loop stopped")

    def iterate(self) -> None:
        """One scheduler iteration (blocks briefly on the inbox when idle)."""
        idle = not (self.waiting or self.prefilling or self.running)
        self._drain_inbox(block=idle)
        self._admit()
        self._prefill_some()
        if self.running:
            self._decode_step()
        self._flush()
        metrics.RUNNING.set(len(self.running) + len(self.prefilling))
        metrics.WAITING.set(len(self.waiting))

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd, arg = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "submit":
                req, sink = arg
                self.sinks[req.request_id] = sink
                seq = Sequence(req, self.tok.detokenizer(), self._stop_ids(req))
                self.waiting.append(seq)
            elif cmd == "finish_all":
                self._finish_everything()
            elif cmd == "cancel":
                request_id, sent = arg
                self._cancel(request_id, sent)
            try:
                cmd, arg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _stop_ids(self, req: GenerationRequest) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if self.tok.eos_id is not None and not req.params.ignore_eos:
            ids.add(self.tok.eos_id)
        return ids

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.limits.max_running:
            seq = self.waiting.popleft()
            metrics.QUEUE_TIME.observe(time.monotonic() - seq.arrival)
            self.prefilling.append(seq)

    # ---- prefill ---------------------------------------------------------------------
    def _prefill_some(self) -> None:
        """Prefill waiting prompts under the iteration's token budget. With a recurrent model,
        prompts that need no prompt log-probs are prefilled together in one ragged batch
        (64 prompts of 16 tokens: one pass instead of 64)."""
        budget = self.limits.step_token_budget
        if self.model.cfg.is_recurrent:
            budget = self._prefill_batched(budget)
        while self.prefilling and budget > 0:
            seq = self.prefilling[0]
            todo = seq.to_prefill
            logits = None
            if todo:
                n = min(len(todo), self.limits.prefill_chunk, budget)
                ids = torch.tensor([todo[:n]])
                logits, seq.state = self.model.prefill(
                    ids, seq.state, all_logits=seq.prompt_logprobs is not None)
                if seq.prompt_logprobs is not None:
                    self._add_prompt_logprobs(seq, logits[0], todo[:n])
                    logits = logits[:, -1]
                seq.prefilled += n
                budget -= n
                metrics.PROMPT_TOKENS.inc(n)
            if seq.prefilled >= seq.prefill_target:
                self.prefilling.popleft()
                self._prefill_done(seq, logits)

    def _prefill_batched(self, budget: int) -> int:
        """One ragged prefill over the leading prompts that fit the budget (padded size);
        returns the budget left. Prompts with prompt log-probs go the one-by-one way."""
        group: list[tuple[Sequence, int]] = []
        for seq in self.prefilling:
            todo = len(seq.to_prefill)
            if seq.prompt_logprobs is not None or todo == 0:
                break
            n = min(todo, self.limits.prefill_chunk)
            longest = max([n] + [m for _, m in group])
            if group and longest * (len(group) + 1) > budget:
                break
            group.append((seq, n))
        if len(group) < 2:
            return budget
        logits, states = self.model.prefill_ragged(
            [seq.to_prefill[:n] for seq, n in group], [seq.state for seq, _ in group])
        for i, (seq, n) in enumerate(group):
            seq.state = states[i]
            seq.prefilled += n
            metrics.PROMPT_TOKENS.inc(n)
            if seq.prefilled >= seq.prefill_target:
                self.prefilling.remove(seq)
                self._prefill_done(seq, logits[i : i + 1])
        return budget - max(n for _, n in group) * len(group)

    def _prefill_done(self, seq: Sequence, logits: torch.Tensor | None) -> None:
        """A prompt is in: hand a prefill-only request its state, else start decoding."""
        if seq.prefill_only or logits is None:
            seq.finish_reason = "prefilled"
            state = seq.state if seq.state is not None else self.model.new_state(1)
            self._finish(seq, state, seq.req.input_ids[seq.prefill_target :])
        else:
            self._start_decoding(seq, logits)

    def _add_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, ids: list[int]) -> None:
        """Log-probs of prompt tokens: token j is scored by the logits at j-1."""
        assert seq.prompt_logprobs is not None
        if seq.prefilled == 0:
            seq.prompt_logprobs.append(TokenLogprob(ids[0], None))
        logp = torch.log_softmax(logits.float(), -1)
        for j, tid in enumerate(ids):
            row = seq.last_prompt_logp if j == 0 else logp[j - 1]
            if row is not None:
                seq.prompt_logprobs.append(TokenLogprob(tid, float(row[tid])))
        seq.last_prompt_logp = logp[-1]

    def _start_decoding(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the first token from the prompt's last logits and join the batch."""
        counts = torch.zeros(1, self.model.cfg.vocab_size)
        seen = torch.zeros(1, self.model.cfg.vocab_size, dtype=torch.bool)
        seen[0, torch.tensor(seq.req.input_ids)] = True
        token = self._sample([seq], logits, counts, seen)
        if seq.finish_reason is not None or seq.cancelled:
            self._finish(seq, seq.state, [token])
            return
        assert seq.state is not None
        self.pool.add(seq.state, seq.req.input_ids, [token])
        seq.state = None
        self.running.append(seq)
        self._emit(seq)

    # ---- decode ----------------------------------------------------------------------
    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        self.pool.reserve_step()
        tokens = torch.tensor([s.last_token for s in self.running])
        logits = self.model.step(tokens, self.pool.view())
        n = self.pool.n
        self._sample(self.running, logits, self.pool.counts[:n], self.pool.seen[:n])
        self.steps += 1
        metrics.BATCH_SIZE.set(n)
        metrics.STEP_TIME.observe(time.perf_counter() - t0)
        finished = []
        for seq in self.running:
            self._emit(seq)
            if seq.finish_reason is not None:
                finished.append(seq)
        for seq in finished:
            self._retire(seq)

    def _batch_params(self, seqs: list[Sequence]) -> tuple[BatchParams, bool]:
        """Column tensors of the rows' parameters, and whether any row uses penalties.
        Rebuilt only when the running batch changes (not every step)."""
        key = tuple(s.req.request_id for s in seqs)
        if self._bp_cache is not None and self._bp_cache[0] == key:
            return self._bp_cache[1], self._bp_cache[2]
        params = [s.params for s in seqs]
        use_pen = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                      for p in params)
        bp = BatchParams.from_params(params)
        if seqs is self.running:
            self._bp_cache = (key, bp, use_pen)
        return bp, use_pen

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, counts: torch.Tensor,
                seen: torch.Tensor) -> int:
        """Sample one token per row, record it on each sequence; returns row 0's token."""
        params = [s.params for s in seqs]
        bp, use_pen = self._batch_params(seqs)
        tokens = sample(logits, bp, [s.generator for s in seqs],
                        counts if use_pen else None, seen if use_pen else None)
        n_lp = max((p.logprobs or 0) for p in params)
        entries: list[TokenLogprob | None] = [None] * len(seqs)
        if any(p.logprobs is not None for p in params):
            chosen, values, ids = top_logprobs(logits, tokens, n_lp)
            packed = logprob_entries(chosen, values, ids, tokens, n_lp)
            entries = [e if p.logprobs is not None else None
                       for e, p in zip(packed, params, strict=True)]
        if use_pen and seqs is self.running:  # only penalised rows read the counts
            self.pool.record(tokens)
        for seq, tok, entry in zip(seqs, tokens.tolist(), entries, strict=True):
            seq.add_token(tok, entry)
        metrics.GENERATION_TOKENS.inc(len(seqs))
        return int(tokens[0])

    def _retire(self, seq: Sequence, sent: int | None = None) -> None:
        """Remove a finished running sequence from the batch (its state goes with it).

        ``sent``: tokens the client actually received (on cancellation). If fewer than were
        generated, the session state is rebuilt from the request's start state so that it
        ends exactly after the last token the client was sent.
        """
        slot = self.running.index(seq)
        state = None
        pending = [seq.generated[-1]]
        if seq.req.want_state:
            if sent is None or sent >= len(seq.generated):
                state = self.pool.take(slot)
            else:
                state, pending = self._replay(seq, sent)
        moved = self.pool.remove(slot)
        last = self.running.pop()
        if moved is not None:
            self.running[slot] = last
        self._finish(seq, state, pending)

    def _replay(self, seq: Sequence, sent: int) -> tuple[State, list[int]]:
        """State after input + the first ``sent`` generated tokens (last one left pending)."""
        stream = seq.req.input_ids + seq.generated[:sent]
        seq.generated = seq.generated[:sent]
        state = seq.req.start_state
        feed = stream[:-1]
        for i in range(0, len(feed), self.limits.prefill_chunk):
            _, state = self.model.prefill(torch.tensor([feed[i : i + self.limits.prefill_chunk]]),
                                          state)
        return (state if state is not None else self.model.new_state(1)), stream[-1:]

    # ---- output ----------------------------------------------------------------------
    def _emit(self, seq: Sequence) -> None:
        sink = self.sinks.get(seq.req.request_id)
        if sink is None or seq.finish_reason is not None:
            return  # the final delta is sent by _finish
        out = seq.take_output()
        if out.text or out.token_ids or out.prompt_logprobs:
            self._outbox.append((sink, out))

    def _finish(self, seq: Sequence, state: State | None, pending: list[int]) -> None:
        sink = self.sinks.pop(seq.req.request_id, None)
        with self._lock:
            self._inflight -= 1
        if seq.finish_reason is None:
            seq.finish_reason = "cancelled"
        out = seq.take_output()
        if seq.req.want_state and state is not None:
            out.final_state = state
            out.final_pending = pending
        metrics.REQUESTS.labels(status=seq.finish_reason).inc()
        if sink is not None:
            self._outbox.append((sink, out))

    def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self.deliver(batch)

    def _cancel(self, request_id: str, sent: int | None) -> None:
        for queue_ in (self.waiting, self.prefilling):
            for seq in queue_:
                if seq.req.request_id == request_id:
                    queue_.remove(seq)
                    seq.cancelled = True
                    self._finish(seq, None, [])  # session unchanged: nothing was generated
                    return
        for seq in self.running:
            if seq.req.request_id == request_id:
                seq.cancelled = True
                seq.finish_reason = "cancelled"
                self._retire(seq, sent)
                return

    def _finish_everything(self) -> None:
        for seq in [*self.waiting, *self.prefilling]:
            seq.finish_reason = "length"
            self._finish(seq, None, [])
        self.waiting.clear()
        self.prefilling.clear()
        for seq in list(self.running):
            seq.finish_reason = "length"
            self._retire(seq)

    def _fail_all(self, message: str) -> None:
        for seq in [*self.waiting, *self.prefilling, *self.running]:
            sink = self.sinks.pop(seq.req.request_id, None)
            with self._lock:
                self._inflight -= 1
            if sink is not None:
                self._outbox.append((sink, Output(finish_reason="error", error=message)))
        self.waiting.clear()
        self.prefilling.clear()
        self.running.clear()
        self.pool = SlotPool(self.model, self.limits.max_running)
        self._flush()
