"""The engine's use of the prefix cache: which requests look up, which states are stored
and when, and the metrics. Runs on the engine thread only (no locks).

- Looked up: every request without a start state (no ``session_id``) and without prompt
  log-probs (those need the logits of every prompt token). The hit leaves at least the last
  prompt token to prefill, whose logits the first sample needs.
- Stored, at no copy: the state at the end of every prompt's prefill, every ``interval``
  tokens inside a long prefill (``prefill`` returns a fresh state per chunk), at the
  *branch point* where a prompt leaves the path of an earlier one (its prefill stops there
  once): a system prompt shared by many requests is kept after the second one, whatever
  its length; a prompt sent again whole (a retry, samples of one prompt) is kept one token
  short of its end, where every later copy resumes and runs that token alone (a state at
  the end cannot serve it: the first sample needs the last token's logits); and at a
  request's ``keep_at``: where a chat template's generation prompt
  begins, which is where the next turn's rendering of the conversation leaves this prompt
  (``<|im_start|>assistant\n<think>\n\n</think>\n\n`` becomes the reply's own header), so
  the conversation prefilled after the reply resumes there and runs only the reply.
- Stored, at one row copy: the state after a finished generation (input + generated tokens
  but the last), so a client that resends the whole conversation resumes after the reply.
  A chat reply's stop string ``\\nUser:`` is exactly how the next turn's rendering goes on,
  so that entry matches the next turn with no replay; only a reply whose sampled tokens do
  not spell its resent form is re-tokenised and replayed (``linserve.server.engine.replay``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from linserve.model.interface import State
from linserve.server import metrics
from linserve.server.engine.sequence import Sequence
from linserve.server.prefix_cache.radix import PrefixCache

Publish = Callable[[list[int], State], None]


def memory_parts(state: State) -> dict[Hashable, int]:
    """The bytes of ``state``'s tensors by the storage they are in: the entries of one long
    prefill share their keys' (:class:`linserve.model.state.SharedKV`), counted once."""
    storages = (t.untyped_storage() for t in state.tensors().values())
    return {s.data_ptr(): s.nbytes() for s in storages if s.nbytes()}
MIN_BRANCH = 8  # a shared stretch shorter than this is not worth a state of its own
GENERATION_ROOM = 1024  # the most slots a prompt's buffers keep for its reply's keys


class EnginePrefixCache:
    def __init__(self, max_bytes: int, interval: int, publish: Publish | None = None) -> None:
        self.cache: PrefixCache[State] = PrefixCache(max_bytes)
        self.interval = interval
        self.publish = publish  # shares entries with other replicas (Redis), if set
        self._evictions = 0

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        return seq.req.start_state is None and seq.prompt_logprobs is None

    def lookup(self, seq: Sequence) -> None:
        """Start ``seq`` from the longest cached prefix of its input, if any."""
        if not self.eligible(seq):
            return
        ids = seq.req.input_ids
        limit = seq.prefill_target if seq.prefill_only else seq.prompt_len - 1
        hit = self.cache.match(ids, limit)
        metrics.PREFIX_QUERIES.inc(len(ids))
        depth = hit.depth
        if hit.state is not None:
            seq.state, seq.prefilled, seq.cached = hit.state, hit.depth, hit.depth
        remote = seq.req.prefix_state
        if remote is not None and depth < seq.req.prefix_depth <= limit:
            depth = seq.req.prefix_depth
            seq.state, seq.prefilled, seq.cached = remote, depth, depth
            metrics.PREFIX_REMOTE_HITS.inc(depth)
            self._insert(ids[:depth], remote, publish=False)
        if depth:
            metrics.PREFIX_HITS.inc(depth)
        branch = min(hit.shared, limit)  # a prompt seen whole: its last token's start
        if depth + MIN_BRANCH <= branch:
            seq.branch = branch  # an earlier prompt went this way: keep a state here
        self._update_metrics()

    def after_prefill(self, seq: Sequence, n: int) -> None:
        """``seq`` just prefilled ``n`` more tokens: keep its state at the prompt's end and
        at interval crossings."""
        if not self.eligible(seq) or seq.state is None or n <= 0:
            return
        done = seq.prefilled
        crossed = self.interval > 0 and done // self.interval > (done - n) // self.interval
        landmark = done >= seq.prefill_target or done in seq.keep_points
        if landmark or crossed:
            self._insert(seq.req.input_ids[:done], seq.state, publish=landmark)

    def after_generation(self, seq: Sequence, take_row: State) -> None:
        """Keep the state after input + generated[:-1] (``take_row``: a copy of the row),
        its KV caches in the prompt's buffers where the prompt's state is kept (the reply
        after a long document adds its own tokens' keys, not a second copy of the
        document's)."""
        prompt = self.cache.get(seq.req.input_ids)
        if prompt is not None:
            take_row.join(prompt)
        self._insert(seq.req.input_ids + seq.generated[:-1], take_row)

    @staticmethod
    def room(seq: Sequence) -> int:
        """Slots past the prompt its prefill leaves in its KV buffers for the reply's keys,
        which the entry kept after the reply then writes there (:meth:`after_generation`);
        untouched, they cost address space only."""
        return min(seq.params.max_tokens, GENERATION_ROOM) if EnginePrefixCache.eligible(seq) \
            else 0

    def insert(self, tokens: list[int], state: State) -> None:
        """Keep ``state`` as the state after ``tokens`` (a replay's result)."""
        self._insert(tokens, state)

    def _insert(self, tokens: list[int], state: State, publish: bool = True) -> None:
        state.trim_kv()  # a prompt's state has KV room for its growth, which an entry never uses
        if self.cache.insert(tokens, state, memory_parts(state)) and publish and self.publish:
            self.publish(tokens, state)
        self._update_metrics()

    def _update_metrics(self) -> None:
        stats = self.cache.stats
        if stats.evictions > self._evictions:
            metrics.PREFIX_EVICTIONS.inc(stats.evictions - self._evictions)
            self._evictions = stats.evictions
        metrics.PREFIX_BYTES.set(self.cache.bytes)
        metrics.PREFIX_ENTRIES.set(len(self.cache))
        metrics.PREFIX_BUDGET.set(self.cache.max_bytes)
        metrics.PREFIX_LONGEST.set(self.cache.longest)
        metrics.PREFIX_SHARED.set(self.cache.shared_bytes)
        if stats.queried_tokens:
            metrics.PREFIX_HIT_RATE.set(stats.hit_tokens / stats.queried_tokens)
