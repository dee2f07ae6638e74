"""Plain data passed between the HTTP process and the engine, torch-free. States cross as
blobs (:class:`~linserve.model.blob_view.StateBlob`: ``start_blob``, ``final_blob``); the
engine's side of the border (:mod:`linserve.server.engine.calls`) turns them into the
model's :class:`~linserve.model.state.State` (``start_state``, ``final_state``) and back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from linserve.model.blob_view import StateBlob
from linserve.model.inputs import Insert
from linserve.model.sampling_params import SamplingParams
from linserve.server.grammar.spec import GrammarSpec

if TYPE_CHECKING:
    from linserve.model.state import State


# A Prometheus call the engine process made, replayed in the HTTP process's registry:
# (metric, labels, op, value).
MetricEvent = tuple[str, tuple[tuple[str, str], ...], str, float]


class Overloaded(Exception):
    """The engine's queue is full; the caller should answer 429."""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated (or prompt) token with its log-probability and the top alternatives."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationRequest:
    """What to run: ``input_ids`` are fed after ``start_blob`` (a session's state or None;
    the engine reads it as ``start_state``)."""

    request_id: str
    input_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    start_blob: StateBlob | None = None
    start_state: State | None = None  # the engine's side only
    start_tokens: int = 0
    prompt_logprobs: bool = False
    want_state: bool = False
    chat: bool = False  # the session keeps the reply as a chat transcript (sessions.transcript)
    grammar: GrammarSpec | None = None  # structured outputs: what the output must match
    fault: str | None = None  # test-only fault injection point (settings.fault_injection)
    kind: str = "client"  # for the prompt-token counters: client, next_turn or session
    # also keep prefix-cache states after input_ids[:k] for each k (where a chat template's
    # generation prompt begins; right after an image)
    keep_at: tuple[int, ...] = ()
    # A prefix state fetched from another replica (server.prefix_cache.remote): the state
    # after input_ids[:prefix_depth], as bytes across processes, decoded by the engine side.
    prefix_depth: int = 0
    prefix_blob: bytes | None = None
    prefix_state: State | None = None
    # Items that are not text (linserve.model.inputs): input_ids holds their virtual ids at
    # their positions, and each one's payload crosses to the engine, which encodes it.
    inserts: tuple[Insert, ...] = ()


@dataclass(slots=True)  # one per streamed token and row: slots make it cheaper to build
class Output:
    """A delta of one request, delivered in order. The last one has ``finish_reason`` set."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    final_state: State | None = None  # the engine's side only; crosses as final_blob
    final_blob: StateBlob | None = None
    final_pending: list[int] = field(default_factory=list)
    final_tokens: int = 0  # tokens the session holds with final_state (pending included)
    error: str | None = None  # set (with finish_reason "error") when the request failed
    error_status: int = 500  # 500: this request failed; 503: the engine went down
    stop_string: str | None = None  # on the last delta: the stop string that ended it

    def merge(self, later: Output) -> Output:
        """Coalesce two consecutive deltas into one (for slow readers)."""
        return Output(
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=self.logprobs + later.logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            finish_reason=later.finish_reason,
            prompt_tokens=max(self.prompt_tokens, later.prompt_tokens),
            completion_tokens=max(self.completion_tokens, later.completion_tokens),
            cached_tokens=max(self.cached_tokens, later.cached_tokens),
            final_state=later.final_state,
            final_blob=later.final_blob,
            final_pending=later.final_pending,
            final_tokens=later.final_tokens,
            error=later.error,
            error_status=later.error_status,
            stop_string=later.stop_string,
        )
