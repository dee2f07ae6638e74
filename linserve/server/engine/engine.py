"""The engine: one thread owns the model and runs the continuous-batching loop.

Each iteration it (1) takes new requests and cancellations from its inbox, (2) prefills
waiting prompts in chunks under a token budget, and (3) runs ONE batched ``step`` over every
running sequence, samples all rows at once, and hands the deltas to the event loop in a
single thread-safe call. HTTP handlers never touch tensors; they talk to :class:`EngineClient`.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from linserve.model.heap import trim
from linserve.model.inputs import EncodedCache, InsertTable, is_virtual, text_ids
from linserve.model.interface import ServedModel, State
from linserve.server import metrics
from linserve.server.engine.memory import engine_parts
from linserve.server.engine.pool import SlotPool
from linserve.server.engine.replay import Replay, ReplayQueue
from linserve.server.engine.row_sampler import RowSampler
from linserve.server.engine.sequence import Sequence
from linserve.server.engine.speculation import Speculator
from linserve.server.engine.types import GenerationRequest, Output, Overloaded, TokenLogprob
from linserve.server.grammar.engine_side import EngineGrammars
from linserve.server.prefix_cache.engine_side import EnginePrefixCache, Publish
from linserve.server.sessions.transcript import (
    chat_next_turn_text,
    chat_turn_text,
    common_prefix,
    session_tokens,
)
from linserve.server.speculative.config import SpeculativeConfig

log = logging.getLogger("linserve.engine")
Sink = Callable[[Output], None]
Deliver = Callable[[list[tuple[Sink, Output]]], None]


@dataclass
class EngineLimits:
    max_running: int = 64
    max_waiting: int = 256
    prefill_chunk: int = 512
    step_token_budget: int = 512
    prefix_cache_bytes: int = 0
    prefix_cache_interval: int = 1024
    state_budget: int = 0  # bytes growing states (KV caches) may take; 0: no limit


class Engine:
    """Continuous-batching scheduler. Public methods are thread-safe; the loop runs in
    :meth:`run` on its own thread."""

    def __init__(self, model: ServedModel, limits: EngineLimits,
                 deliver: Deliver, beat: Callable[[], None] = lambda: None,
                 publish: Publish | None = None, speculative: SpeculativeConfig | None = None,
                 draft: ServedModel | None = None) -> None:
        self.model = model
        self.tok = model.tokenizer()
        self.limits = limits
        self.deliver = deliver
        self.pool = SlotPool(model, limits.max_running)
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.reserved = 0  # state bytes the admitted sequences may grow to
        self.running: list[Sequence] = []  # running[i] lives in pool slot i
        self.replays = ReplayQueue(model, limits.prefill_chunk)
        self.beat = beat  # called once per iteration (the supervisor's heartbeat)
        self.prefix = (EnginePrefixCache(limits.prefix_cache_bytes, limits.prefix_cache_interval,
                                         publish) if limits.prefix_cache_bytes > 0 else None)
        self.grammars = EngineGrammars(self.tok, model.info.vocab_size)
        self.sinks: dict[str, Sink] = {}
        self._inflight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._outbox: list[tuple[Sink, Output]] = []
        self.sampler = RowSampler(self.pool, self.grammars)
        self.encoded = EncodedCache()  # items' embeddings by digest
        self.steps = 0
        self._memory_reported = 0.0
        self._busy = False
        self.spec: Speculator | None = None
        if speculative is not None:
            self.spec = Speculator(model, self.pool, self.sampler, speculative, draft)
            self.spec.calibrate()

    # ---- thread-safe API -------------------------------------------------------------
    def submit(self, req: GenerationRequest, sink: Sink) -> None:
        """Queue a request; raises :class:`Overloaded` past running + waiting capacity."""
        with self._lock:
            if self._inflight >= self.limits.max_running + self.limits.max_waiting:
                raise Overloaded
            self._inflight += 1
        if req.grammar is not None:
            self.grammars.prepare(req.grammar)  # compiled here, not on the engine loop
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
            except Exception:  # a failure no single request could be blamed for
                log.exception("engine iteration failed; failing the running requests")
                self._fail_all("internal engine error")
        log.info("engine loop stopped")

    def iterate(self) -> None:
        """One scheduler iteration (blocks briefly on the inbox when idle)."""
        self.beat()
        idle = not (self.waiting or self.prefilling or self.running or self.replays)
        if idle and self._busy:  # a burst just ended: its scratch goes back to the system
            trim()
        self._busy = not idle
        self._drain_inbox(block=idle)
        self._admit()
        self._prefill_some()
        if self.running:
            self._decode_step()
        self._flush()
        metrics.RUNNING.set(len(self.running) + len(self.prefilling))
        metrics.WAITING.set(len(self.waiting))
        self._report_memory()

    def memory_parts(self) -> dict[str, int]:
        """Bytes the engine's tensors hold, by part (:mod:`linserve.server.engine.memory`)."""
        held = [s.state for s in self.prefilling] + [s.snapshot for s in self.running]
        held += [job.state for job in self.replays.jobs]
        prefix = self.prefix.cache.states() if self.prefix is not None else []
        return engine_parts(self.model.info, self.pool.state, [self.pool.counts,
                                                                self.pool.seen], held, prefix)

    def _report_memory(self) -> None:
        """``linserve_memory_bytes`` for the engine's parts, at most once a second."""
        now = time.monotonic()
        if now - self._memory_reported < 1.0:
            return
        self._memory_reported = now
        for part, nbytes in self.memory_parts().items():
            metrics.MEMORY.labels(part=part).set(nbytes)

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd, arg = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "submit":
                self._accept(*arg)
            elif cmd == "finish_all":
                self._finish_everything()
            elif cmd == "cancel":
                request_id, sent_tokens = arg
                self._cancel(request_id, sent_tokens)
            try:
                cmd, arg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(self, req: GenerationRequest, sink: Sink) -> None:
        self.sinks[req.request_id] = sink
        try:
            seq = Sequence(req, self.tok.detokenizer(), self._stop_ids(req))
            if req.fault == "submit":
                raise RuntimeError("injected fault: submit")
            if req.fault == "deadlock":  # the engine thread waits on a lock held by itself
                held = threading.Lock()
                held.acquire()
                held.acquire()
            if req.grammar is not None:
                seq.matcher = self.grammars.matcher(req.grammar)
            if self.prefix is not None:
                self.prefix.lookup(seq)
                metrics.PROMPT_REUSED.labels(kind=req.kind).inc(seq.cached)
        except Exception as exc:
            log.exception("request %s rejected by the engine", req.request_id)
            self._fail_unstarted(req, f"the engine could not start this request: {exc}")
            return
        self.waiting.append(seq)

    def _fail_unstarted(self, req: GenerationRequest, message: str) -> None:
        sink = self.sinks.pop(req.request_id, None)
        with self._lock:
            self._inflight -= 1
        metrics.REQUESTS.labels(status="error").inc()
        if sink is not None:
            self._outbox.append((sink, Output(finish_reason="error", error=message)))

    def _stop_ids(self, req: GenerationRequest) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids.update(self.tok.eos_ids)
        return ids

    def state_need(self, seq: Sequence) -> int:
        """The most bytes ``seq``'s state can grow to (its KV part at the full length)."""
        per_token = self.model.info.state_bytes_per_token
        return per_token * (seq.req.start_tokens + seq.prompt_len + seq.req.params.max_tokens)

    def _admit(self) -> None:
        """Move waiting sequences to prefill while there are rows, and bytes for their
        states' growth (``state_budget``): one that does not fit waits for others to
        finish; one that could never fit, even alone, fails."""
        budget = self.limits.state_budget
        while self.waiting and len(self.running) + len(self.prefilling) < self.limits.max_running:
            seq = self.waiting[0]
            need = self.state_need(seq)
            if budget and self.reserved + need > budget:
                if self.running or self.prefilling:
                    break  # room comes back as sequences finish
                self.waiting.popleft()
                self._fail_unstarted(seq.req, f"this request's state needs {need:,} bytes, "
                                     f"more than the engine's budget of {budget:,}")
                continue
            self.waiting.popleft()
            if seq.req.inserts and not self._encode(seq):
                continue
            seq.reserved, self.reserved = need, self.reserved + need
            metrics.QUEUE_TIME.observe(time.monotonic() - seq.arrival)
            self.prefilling.append(seq)

    def _encode(self, seq: Sequence) -> bool:
        """Encode ``seq``'s items (each one's embeddings kept by digest: an item sent again
        is not encoded again); False, the request failed alone, where the model takes no
        items of a kind or the encoder refused one."""
        table, encoders = InsertTable(), self.model.encoders()
        try:
            if seq.prefill_only and is_virtual(seq.req.input_ids[-1]):
                raise ValueError("a prompt that only builds a state cannot end with an item")
            for item in seq.req.inserts:
                if item.kind not in encoders:
                    raise ValueError(f"this model takes no {item.kind} input")
                key = f"{item.kind}:{item.digest}"
                embeds = self.encoded.get(key)
                if embeds is None:
                    embeds = encoders[item.kind].encode(item)
                    self.encoded.put(key, embeds)
                table.add(item, embeds)
        except Exception as exc:
            self._fail_unstarted(seq.req, f"the request's {seq.req.inserts[0].kind} input "
                                 f"could not be used: {exc}")
            return False
        seq.inserts = table
        return True

    # ---- prefill ---------------------------------------------------------------------
    def _prefill_some(self) -> None:
        """Spend the iteration's token budget: session replays first, then prompts. With a
        recurrent model, prompts that need no prompt log-probs are prefilled together in one
        ragged batch (64 prompts of 16 tokens: one pass instead of 64)."""
        t0 = time.perf_counter()
        budget = self.replays.run(self.limits.step_token_budget)
        if self.model.info.ragged_prefill and budget > 0:
            budget = self._prefill_batched(budget)
        while self.prefilling and budget > 0:
            seq = self.prefilling[0]
            try:
                spent = self._prefill_one(seq, budget)
                if spent == 0 and self.prefilling and self.prefilling[0] is seq:
                    break  # waits for a fresh budget (an aligned chunk)
                budget -= spent
            except Exception as exc:
                log.exception("prefill of %s failed", seq.req.request_id)
                if self.prefilling and self.prefilling[0] is seq:
                    self.prefilling.popleft()
                seq.fail(f"prefill failed: {exc}")
                self._finish(seq, None, [])
        if budget < self.limits.step_token_budget:
            metrics.PREFILL_TIME.observe(time.perf_counter() - t0)

    def _prefill_one(self, seq: Sequence, budget: int) -> int:
        """Prefill the next chunk of ``seq``; returns the tokens spent."""
        if seq.req.fault == "prefill":
            raise RuntimeError("injected fault: prefill")
        todo = seq.to_prefill
        logits = None
        n = 0
        if todo:
            n = self.model.prefill_split(len(todo), self.limits.prefill_chunk, budget)
            if n == 0:  # the budget left is less than one aligned chunk
                return 0
            ids = torch.tensor([todo[:n]])
            logits, seq.state = self.model.prefill(
                ids, seq.state, all_logits=seq.prompt_logprobs is not None,
                inserts=seq.inserts, room=self._room(seq))
            if seq.prompt_logprobs is not None:
                self._add_prompt_logprobs(seq, logits[0], todo[:n])
                logits = logits[:, -1]
            self._consumed(seq, n)
        if seq.prefilled >= seq.prefill_target:
            self.prefilling.popleft()
            self._prefill_done(seq, logits)
        return n

    def _room(self, seq: Sequence) -> int:
        """The tokens ``seq``'s prefill state makes room for: the rest of its prompt, and
        where the prefix cache keeps the state after the reply, the reply's."""
        rest = seq.prefill_target - seq.prefilled
        return rest + (self.prefix.room(seq) if self.prefix is not None else 0)

    def _consumed(self, seq: Sequence, n: int) -> None:
        """``seq``'s state now holds ``n`` more of its prompt's tokens."""
        seq.prefilled += n
        metrics.PROMPT_TOKENS.inc(n)
        metrics.PROMPT_COMPUTED.labels(kind=seq.req.kind).inc(n)
        if self.prefix is not None:
            self.prefix.after_prefill(seq, n)

    def _prefill_batched(self, budget: int) -> int:
        """One ragged prefill over the leading prompts that fit the budget (padded size);
        returns the budget left. Prompts with prompt log-probs go the one-by-one way, and so
        does a group whose batched prefill failed (so the failure is pinned on one request)."""
        group: list[tuple[Sequence, int]] = []
        for seq in self.prefilling:
            todo = len(seq.to_prefill)
            if seq.prompt_logprobs is not None or todo == 0 or seq.solo or seq.inserts:
                break
            n = self.model.prefill_split(todo, self.limits.prefill_chunk, todo)
            longest = max([n] + [m for _, m in group])
            if group and longest * (len(group) + 1) > budget:
                break
            group.append((seq, n))
        if len(group) < 2:
            return budget
        try:
            if any(seq.req.fault == "prefill" for seq, _ in group):
                raise RuntimeError("injected fault: prefill")
            logits, states = self.model.prefill_ragged(
                [seq.to_prefill[:n] for seq, n in group], [seq.state for seq, _ in group])
        except Exception:
            log.exception("batched prefill failed; retrying its prompts one by one")
            for seq, _ in group:
                seq.solo = True
            return budget
        for i, (seq, n) in enumerate(group):
            seq.state = states[i]
            self._consumed(seq, n)
            if seq.prefilled >= seq.prefill_target:
                self.prefilling.remove(seq)
                self._prefill_done(seq, logits[i : i + 1])
        return budget - max(n for _, n in group) * len(group)

    def _guarded(self, seq: Sequence, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn``; if it raises, fail ``seq`` alone (it is in no queue nor the batch)."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("request %s failed", seq.req.request_id)
            seq.fail(f"internal error: {exc}")
            self._finish(seq, None, [])

    def _prefill_done(self, seq: Sequence, logits: torch.Tensor | None) -> None:
        """A prompt is in: hand a prefill-only request its state, else start decoding."""
        if seq.req.kind == "next_turn":  # what the post-reply prefill found and ran
            log.info(json.dumps({"event": "next_turn_prefill", "id": seq.req.request_id,
                                 "tokens": seq.prompt_len, "reused": seq.cached,
                                 "computed": seq.prefilled - seq.cached}))
        if seq.prefill_only or logits is None:
            seq.finish_reason = "prefilled"
            state = seq.state if seq.state is not None else self.model.new_state(1)
            self._finish(seq, state, seq.req.input_ids[seq.prefill_target :])
        else:
            self._guarded(seq, self._start_decoding, seq, logits)

    def _add_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, ids: list[int]) -> None:
        """Log-probs of prompt tokens: token j is scored by the logits at j-1."""
        assert seq.prompt_logprobs is not None
        if seq.prefilled == 0:
            seq.prompt_logprobs.append(TokenLogprob(ids[0], None))
        logp = torch.log_softmax(logits.float(), -1)
        for j, tid in enumerate(ids):
            row = seq.last_prompt_logp if j == 0 else logp[j - 1]
            if row is not None:  # an item's positions (virtual ids) have no log-prob
                seq.prompt_logprobs.append(TokenLogprob(
                    tid, None if is_virtual(tid) else float(row[tid])))
        seq.last_prompt_logp = logp[-1]

    def _start_decoding(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the first token from the prompt's last logits and join the batch."""
        if seq.req.fault == "first_token":
            raise RuntimeError("injected fault: first_token")
        counts = torch.zeros(1, self.model.info.vocab_size)
        seen = torch.zeros(1, self.model.info.vocab_size, dtype=torch.bool)
        seen[0, torch.tensor(text_ids(seq.req.input_ids), dtype=torch.long)] = True
        token = self.sampler.sample([seq], logits, counts, seen)
        if seq.finish_reason is not None or seq.cancelled:
            self._finish_unpooled(seq, token)
            return
        assert seq.state is not None
        self.pool.add(seq.state, text_ids(seq.req.input_ids), [token])
        # The prompt's state is kept (pool.add copied it) so that a session can be rebuilt
        # from it at the cost of the generated tokens alone.
        keep = seq.req.want_state or (seq.req.chat and self.prefix is not None
                                      and self.prefix.eligible(seq))
        seq.snapshot = seq.state if keep and seq.state is not None \
            and not seq.state.truncatable else None
        seq.state = None
        self.running.append(seq)
        self._emit(seq)

    def _finish_unpooled(self, seq: Sequence, token: int) -> None:
        """A request that ended on its first sampled token (never entered the batch)."""
        if not seq.req.want_state or seq.finish_reason == "error" or seq.state is None:
            self._finish(seq, None, [])
            return
        target = self._session_target(seq, None)
        if target == [token]:
            self._finish(seq, seq.state, [token])
        else:
            self._queue_replay(seq, seq.state, target)

    # ---- decode ----------------------------------------------------------------------
    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        self._end_full_rows()
        if not self.running:
            return
        if self.spec is None or not self.spec.step(self.running):
            self._plain_step()
        n = self.pool.n
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

    def _plain_step(self) -> None:
        """One token for every running row: one batched model step, then sampling."""
        t0 = time.perf_counter()
        self.pool.reserve_step()
        tokens = torch.tensor([s.last_token for s in self.running])
        masks = self.grammars.start([s.matcher for s in self.running])  # beside the step
        logits = self.model.step(tokens, self.pool.view())
        if self.spec is not None:
            self.spec.note_plain_step(len(self.running), time.perf_counter() - t0)
        n = self.pool.n
        try:
            self.sampler.sample(self.running, logits, self.pool.counts[:n], self.pool.seen[:n],
                                masks, pooled=True)
        except Exception:
            log.exception("batched sampling failed; sampling its rows one by one")
            self._sample_rows_alone(logits)

    def _end_full_rows(self) -> None:
        """KV cache: a row at the model's maximum context ends with "length" rather than
        failing the batch's capacity check."""
        limit = self.model.info.context_limit
        if limit is None:
            return
        full = [seq for seq in self.running if seq.total_tokens > limit]
        for seq in full:
            seq.finish_reason = "length"
            self._retire(seq)

    def _sample_rows_alone(self, logits: torch.Tensor) -> None:
        """Isolate a sampling failure: each row alone; a row that still fails ends alone."""
        self.sampler.forget()
        for i, seq in enumerate(self.running):
            if seq.finish_reason is not None:
                continue
            try:
                self.sampler.sample([seq], logits[i : i + 1], self.pool.counts[i : i + 1],
                                    self.pool.seen[i : i + 1])
            except Exception as exc:
                log.exception("sampling failed for %s", seq.req.request_id)
                seq.fail(f"sampling failed: {exc}")

    # ---- finishing -------------------------------------------------------------------
    def _retire(self, seq: Sequence, sent_tokens: int | None = None) -> None:
        """Remove a finished running sequence from the batch and finish it.

        A session request keeps the state that ends exactly where the client's text ends
        (:mod:`linserve.server.sessions.transcript`). When that is not the batch row's state (a
        stop string cut the text, the client left early, or a chat reply is normalised), the state
        is rebuilt by a :class:`Replay` from the prompt's snapshot (recurrent) or from the row
        truncated to the common prefix (KV cache): at most the tokens the client was sent.
        """
        slot = self.running.index(seq)
        if (self.prefix is not None and self.prefix.eligible(seq) and sent_tokens is None
                and seq.finish_reason != "error"):
            self._cache_generation(seq, slot)
        state: State | None = None
        target: list[int] | None = None
        if seq.req.want_state and seq.finish_reason != "error" and sent_tokens != 0:
            target = self._session_target(seq, sent_tokens)
            if target == seq.generated or self.pool.state.truncatable:
                state = self.pool.take(slot)
        moved = self.pool.remove(slot)
        last = self.running.pop()
        if moved is not None:
            self.running[slot] = last
        if target is None:
            self._finish(seq, None, [])
        elif target == seq.generated:
            assert state is not None
            self._finish(seq, state, [seq.generated[-1]])
        else:
            self._rebuild(seq, state, target)

    def _cache_generation(self, seq: Sequence, slot: int) -> None:
        """Give the prefix cache the state after this generation. Usually that is the batch
        row (input + generated[:-1], one row copy). A chat reply whose sampled tokens do not
        spell how a stateless client resends it (a leading double space, a non-canonical
        split) is re-tokenised and replayed instead, under the token budget."""
        assert self.prefix is not None
        gen = seq.generated
        if seq.req.chat:
            target = self.tok.encode(chat_next_turn_text(seq.text))
            if common_prefix(gen[:-1], target) < len(gen) - 1:
                self._cache_replay(seq, slot, self.tok.encode(chat_turn_text(seq.text)))
                return
        self.prefix.after_generation(seq, self.pool.take(slot))

    def _cache_replay(self, seq: Sequence, slot: int, target: list[int]) -> None:
        """Queue the replay whose state the prefix cache keeps after input + ``target``."""
        prefix = self.prefix
        assert prefix is not None
        row = self.pool.take(slot) if seq.snapshot is None else None
        base, keep = self._replay_base(seq, row, target)
        key = seq.req.input_ids + target

        def done(state: State) -> None:
            prefix.insert(key, state)

        def failed(exc: Exception) -> None:
            del exc  # the cache simply lacks this entry

        self.replays.add(Replay(base, target[keep:], done, failed, seq.req.request_id))

    def _session_target(self, seq: Sequence, sent_tokens: int | None) -> list[int]:
        """The generated tokens the session should hold (see
        :mod:`linserve.server.sessions.transcript`)."""
        tokens = seq.generated if sent_tokens is None else seq.generated[:sent_tokens]
        text = seq.text if sent_tokens is None else self.tok.decode(tokens)
        if seq.req.chat:
            target = session_tokens(self.tok, tokens, chat_turn_text(text))
        elif seq.cut or sent_tokens is not None:
            target = session_tokens(self.tok, tokens, text)
        else:
            target = list(tokens)
        seq.kept_tokens = len(target)
        return target

    def _rebuild(self, seq: Sequence, row: State | None, target: list[int]) -> None:
        """Queue the replay that brings the session state to input + ``target``."""
        base, keep = self._replay_base(seq, row, target[:-1])
        self._queue_replay(seq, base, target, keep)

    @staticmethod
    def _replay_base(seq: Sequence, row: State | None, tokens: list[int]
                     ) -> tuple[State, int]:
        """Where a replay towards input + ``tokens`` starts, and how many of ``tokens`` that
        state already holds: a KV row truncated to what it shares with them (the batch row
        holds input + generated[:-1]), else the state kept right after prefill (recurrent
        and window models, whose states cannot be cut back)."""
        if row is not None and row.truncatable and seq.snapshot is None:
            keep = common_prefix(tokens, seq.generated[:-1])
            row.truncate(seq.req.start_tokens + seq.prompt_len + keep)
            return row, keep
        assert seq.snapshot is not None
        return seq.snapshot, 0

    def _queue_replay(self, seq: Sequence, state: State, target: list[int], done: int = 0
                      ) -> None:
        """State after input + target[:done] → after input + target[:-1], pending last."""
        if not target:
            self._finish(seq, state, [])
            return

        def finished(st: State) -> None:
            self._finish(seq, st, target[-1:])

        def failed(exc: Exception) -> None:
            seq.fail(f"the session state could not be rebuilt: {exc}")
            self._finish(seq, None, [])

        self.replays.add(Replay(state, target[done:-1], finished, failed, seq.req.request_id))

    # ---- output ----------------------------------------------------------------------
    def _emit(self, seq: Sequence) -> None:
        sink = self.sinks.get(seq.req.request_id)
        if sink is None or seq.finish_reason is not None:
            return  # the final delta is sent by _finish
        out = seq.take_output()
        if out.text or out.token_ids or out.prompt_logprobs:
            self._outbox.append((sink, out))

    def _finish(self, seq: Sequence, state: State | None, pending: list[int]) -> None:
        if self.spec is not None:
            self.spec.forget(seq)
        self.reserved -= seq.reserved
        seq.reserved = 0
        sink = self.sinks.pop(seq.req.request_id, None)
        with self._lock:
            self._inflight -= 1
        if seq.finish_reason is None:
            seq.finish_reason = "cancelled"
        out = seq.take_output()
        if seq.req.want_state and state is not None:
            out.final_state = state
            out.final_pending = pending
            held = len(seq.generated) if seq.kept_tokens is None else seq.kept_tokens
            out.final_tokens = seq.req.start_tokens + seq.prompt_len + held
        metrics.REQUESTS.labels(status=seq.finish_reason).inc()
        if sink is not None:
            self._outbox.append((sink, out))

    def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self.deliver(batch)

    def _cancel(self, request_id: str, sent_tokens: int | None) -> None:
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
                self._retire(seq, sent_tokens)
                return
        log.info("cancel of %s (%s tokens sent): not queued, prefilling or running", request_id,
                 sent_tokens)

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
        """Last resort after an error no request could be blamed for (the batched step
        itself raised): fail the running batch and queued replays; waiting prompts stay."""
        for seq in self.running:
            seq.fail(message)
            self._finish(seq, None, [])
        self.running.clear()
        self.replays.fail_all(RuntimeError(message))
        self.sampler.forget()
        self.pool.clear()
        self._flush()
