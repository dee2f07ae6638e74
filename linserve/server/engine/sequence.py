"""Engine-side bookkeeping of one request: generated tokens, stop handling, text to emit."""

from __future__ import annotations

import time

import torch
from llguidance import LLMatcher

from linserve.model.inputs import InsertTable
from linserve.model.interface import State
from linserve.model.sampling import request_generator
from linserve.model.tokenizer import IncrementalDetokenizer
from linserve.server.engine.types import GenerationRequest, Output, TokenLogprob
from linserve.server.grammar.engine_side import matcher_error


class Sequence:
    """One request inside the engine.

    Invariant: ``state`` has consumed every token of the request except the last sampled one
    (``last_token``), which the next decode step feeds. A finished sequence's state plus
    ``[last_token]`` as pending input is therefore exactly its session.
    """

    def __init__(self, req: GenerationRequest, detok: IncrementalDetokenizer,
                 stop_ids: set[int]) -> None:
        self.req = req
        self.params = req.params
        self.generator = request_generator(req.params.seed)
        self.detok = detok
        self.stop_ids = stop_ids
        self.state: State | None = req.start_state
        self.prefilled = 0  # input tokens consumed so far
        self.cached = 0  # input tokens taken from the prefix cache
        self.branch = 0  # where this prompt leaves a path the cache has seen (a state is kept)
        self.generated: list[int] = []
        self.last_token: int | None = None
        self.text = ""
        self.chars_sent = 0  # characters of ``text`` already emitted
        self.emitted_tokens = 0  # tokens of ``generated`` already emitted
        # characters held back: the longest stop string less one could still be completing
        self.stop_lookahead = max((len(s) for s in req.stop), default=1) - 1
        self.finish_reason: str | None = None
        self.pending_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = [] if req.prompt_logprobs else None
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.cancelled = False
        self.cut = False  # a stop string truncated the text: the session is rebuilt from it
        self.stop_string: str | None = None  # the stop string that ended the output
        self.error: str | None = None  # why the request failed (finish_reason "error")
        self.kept_tokens: int | None = None  # generated tokens the session keeps (None: all)
        self.reserved = 0  # state bytes the engine set aside for this sequence
        self.snapshot: State | None = None  # state right after the prompt (session replays)
        self.solo = False  # prefill alone (a ragged batch holding it failed once)
        self.inserts: InsertTable | None = None  # its items' embeddings, once encoded
        self.last_prompt_logp: torch.Tensor | None = None  # scores the next prompt chunk's 1st
        self.matcher: LLMatcher | None = None  # structured outputs: the output's matcher
        self.spec_drafted = 0  # speculative decoding: draft tokens verified, and kept
        self.spec_accepted = 0

    @property
    def prefill_only(self) -> bool:
        """max_tokens == 0: build a session state, leaving the last input token pending."""
        return self.params.max_tokens == 0

    @property
    def prefill_target(self) -> int:
        return max(self.prompt_len - 1, 0) if self.prefill_only else self.prompt_len

    @property
    def prompt_len(self) -> int:
        return len(self.req.input_ids)

    @property
    def keep_points(self) -> tuple[int, ...]:
        """Where the prefix cache wants a state inside this prompt: ``branch``, and the
        request's ``keep_at`` (where a chat template's generation prompt begins, right
        after an image)."""
        return self.branch, *self.req.keep_at

    @property
    def to_prefill(self) -> list[int]:
        """Input tokens not yet consumed, leaving the last one for the first sample (and
        stopping first at each of :attr:`keep_points`)."""
        end = self.prefill_target
        for point in self.keep_points:
            if self.prefilled < point < end:
                end = point
        return self.req.input_ids[self.prefilled : end]

    @property
    def total_tokens(self) -> int:
        return self.req.start_tokens + self.prompt_len + len(self.generated)

    def fail(self, message: str) -> None:
        """Mark the request failed; the engine then ends it alone."""
        self.error = message
        self.finish_reason = "error"

    def add_token(self, token: int, logprob: TokenLogprob | None) -> None:
        """Record a sampled token and decide whether the sequence is finished. Runs for every
        row of every step, so the common case (no fault, grammar or stop string) is short."""
        if self.req.fault == "decode" and len(self.generated) >= 2:
            raise RuntimeError("injected fault: decode")
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        generated = self.generated
        generated.append(token)
        self.last_token = token
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        matcher = self.matcher
        if matcher is not None and not matcher.consume_token(token):
            self.fail(f"the output left its grammar: {matcher_error(matcher)}")
            return
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return
        self.text += self.detok.add(token)
        if self.req.stop and self._check_stop_strings():
            return
        if matcher is not None and matcher.is_stopped():
            self.finish_reason = "stop"  # the grammar is complete: nothing more may follow
            return
        if len(generated) >= self.params.max_tokens:
            self.finish_reason = "length"

    def _check_stop_strings(self) -> bool:
        start = max(0, self.chars_sent - self.stop_lookahead)
        hits = [(i, s) for s in self.req.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, self.stop_string = min(hits)
            self.text = self.text[:at]
            self.finish_reason = "stop"
            self.cut = True
            return True
        return False

    def take_output(self) -> Output:
        """The delta since the last call: text safe to show (held back while it could still
        turn into a stop string) and the new tokens."""
        if self.finish_reason in ("length", "cancelled"):
            self.text += self.detok.flush()
        safe = len(self.text) if self.finish_reason else max(
            self.chars_sent, len(self.text) - self.stop_lookahead)
        out = Output(text=self.text[self.chars_sent : safe], logprobs=self.pending_logprobs,
                     finish_reason=self.finish_reason, prompt_tokens=self.prompt_len,
                     completion_tokens=len(self.generated), error=self.error,
                     cached_tokens=self.cached,
                     stop_string=self.stop_string if self.finish_reason else None)
        out.token_ids = self.generated[self.emitted_tokens :]
        self.emitted_tokens = len(self.generated)
        self.chars_sent = safe
        self.pending_logprobs = []
        if self.prompt_logprobs is not None:
            out.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return out

def logprob_entries(chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                    tokens: torch.Tensor, n: int) -> list[TokenLogprob]:
    """Pack ``[B]`` chosen log-probs and ``[B, k]`` top values/ids into per-row entries."""
    out = []
    for i in range(tokens.shape[0]):
        top = tuple(zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True)) if n else ()
        out.append(TokenLogprob(int(tokens[i]), float(chosen[i]), top))
    return out
