"""Request lifecycle between the HTTP routes and the engine: tokenising, limits, sessions.

Routes call :class:`GenerationService`; it validates what the pydantic models cannot
(token ranges, context limits), takes the session's busy-lock, submits to the engine, and
saves the session when the request ends, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from linserve.model.blob_view import StateBlob
from linserve.model.inputs import Insert
from linserve.model.sampling_params import SamplingParams
from linserve.server.api.chat_session import ChatTurn
from linserve.server.api.chat_template import TemplateChat
from linserve.server.api.errors import APIError
from linserve.server.api.next_turn import NextTurns
from linserve.server.api.protocol import SamplingFields, new_id
from linserve.server.api.tool_calls import default_parser
from linserve.server.engine.client import EngineBackend, EngineUnavailable, RequestHandle
from linserve.server.engine.description import ModelDescription
from linserve.server.engine.sizing import state_budget
from linserve.server.engine.types import GenerationRequest, Output, Overloaded
from linserve.server.grammar.compiler import GrammarCompiler
from linserve.server.grammar.spec import GrammarError, GrammarSpec
from linserve.server.prefix_cache.remote import RemotePrefixes
from linserve.server.sessions.store import (
    Session,
    SessionStore,
    SessionUnavailable,
    StaleWrite,
    new_session_id,
)
from linserve.server.sessions.token_cache import PromptTokens
from linserve.server.settings import Settings

log = logging.getLogger("linserve.service")
OVERLOADED_HEADERS = {"Retry-After": "1"}
# A write that fails in flight (Redis going down mid-reply) may still have been applied.
STORE_FAILED = ("the session store failed while saving this reply; the session holds its "
                "previous state, or this reply if the store applied the write before failing")


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    owner: str
    session_id: str | None = None
    state_name: str | None = None  # a named initial state (--state-dir)
    prompt_logprobs: bool = False
    chat: bool = False
    fault: str | None = None
    grammar: GrammarSpec | None = None
    turn: ChatTurn | None = None  # a template chat session's turn (server.api.chat_session)
    # keep prefix-cache states after prompt_ids[:k] for each k (next_turn.py; after an image)
    keep_at: tuple[int, ...] = ()
    inserts: tuple[Insert, ...] = ()  # its images, at their virtual ids in prompt_ids
    # What the session keeps beside its state once the reply is whole (its text, its last
    # output): a stored response (server.api.responses.stored), written with the state.
    meta: Callable[[str, Output], dict[str, Any]] | None = None


def engine_error(out: Output) -> APIError:
    """The client-facing error of a request the engine failed (503 when the engine went
    down and a retry will be served by its replacement, else 500)."""
    assert out.error is not None
    if out.error_status == 503:
        return APIError(503, out.error, None, "engine_unavailable", OVERLOADED_HEADERS)
    return APIError(500, out.error, None, "internal_error")


def chat_template_source(settings: Settings, model: ModelDescription) -> str | None:
    """``--chat-template FILE``, else the checkpoint's own template (None: the plain one)."""
    if settings.chat_template:
        return Path(settings.chat_template).read_text()
    return model.chat_template()


class GenerationService:
    def _special_texts(self) -> tuple[str, str]:
        """The bos and eos tokens' texts for a chat template (eos: the first end id)."""
        eos = self.tok.eos_id
        return "", "" if eos is None else self.tok.token_text(eos)

    def __init__(self, client: EngineBackend, store: SessionStore, model: ModelDescription,
                 settings: Settings) -> None:
        self.client = client
        self.store = store
        self.model = model
        self.info = model.info
        self.model_fingerprint = model.fingerprint()
        self.tok = model.tokenizer()
        self.state_budget = state_budget(settings, model.info)
        template = chat_template_source(settings, model)
        self.chat = TemplateChat(template, *self._special_texts()) if template else None
        self.tool_parser = settings.tool_call_parser or default_parser(template)
        self.prompt_tokens = PromptTokens(self.tok)
        self.settings = settings
        self.named_states = model.named_states
        self._tasks: set[asyncio.Task[None]] = set()
        self.draining: Callable[[], bool] = lambda: False
        self.remote: RemotePrefixes | None = None  # prefix states shared through Redis
        self._grammars: GrammarCompiler | None = None  # validates grammars before the engine
        self.next_turns = (NextTurns(self.chat, self.tok.special_tokens(),
                                     self.prompt_tokens.encode,
                                     lambda ids, items: self.warm(ids, "next_turn", items),
                                     self.spawn, settings.max_prompt_tokens)
                           if self.chat is not None and settings.prefix_cache_bytes > 0
                           and settings.next_turn_cache else None)

    # ---- validation --------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int] | list[str], param: str = "prompt"
                        ) -> list[int]:
        """Token ids of a prompt given as text or ids; 400 for ids outside the vocabulary."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = str(prompt[0])
        if isinstance(prompt, str):
            ids = self.prompt_tokens.encode(prompt) if prompt else []
        else:
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.info.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.info.vocab_size})", param, "invalid_token")
        if len(ids) > self.settings.max_prompt_tokens:
            raise APIError(400, f"prompt has {len(ids)} tokens; the limit is "
                           f"{self.settings.max_prompt_tokens}", param, "context_length_exceeded")
        return ids

    def check_max_tokens(self, max_tokens: int) -> int:
        if max_tokens > self.settings.max_tokens_limit:
            raise APIError(400, f"max_tokens must be at most {self.settings.max_tokens_limit}",
                           "max_tokens", "invalid_value")
        return max_tokens

    def check_stop_ids(self, params: SamplingParams) -> None:
        """Token ids in ``stop_token_ids`` and ``logit_bias`` must be in the vocabulary."""
        if any(not 0 <= t < self.info.vocab_size for t in params.stop_token_ids):
            raise APIError(400, "stop_token_ids must be in the vocabulary", "stop_token_ids")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < self.info.vocab_size]
        if bad:
            raise APIError(400, f"logit_bias token id {bad[0]} is outside the vocabulary "
                           f"[0, {self.info.vocab_size})", "logit_bias", "invalid_token")

    async def grammar_of(self, body: SamplingFields) -> GrammarSpec | None:
        """The request's output constraint, compiled once here (off the event loop; cached
        by its text) so that an invalid schema or grammar is a 400 saying what is wrong,
        before the engine sees it."""
        try:
            spec = body.grammar_spec()
            if spec is None:
                return None
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tok, self.info.vocab_size)
            await asyncio.to_thread(self._grammars.template, spec)
        except GrammarError as exc:
            raise APIError(400, str(exc), exc.param, "invalid_grammar") from exc
        return spec

    def _check_context(self, consumed: int, n_input: int, max_tokens: int) -> None:
        """The full softmax baseline refuses to go past its maximum context."""
        limit = self.info.context_limit
        if limit is None:
            return
        total = consumed + n_input + max_tokens
        if total > limit:
            raise APIError(400, f"this model's maximum context is {limit} tokens; "
                           f"the request needs {total} ({consumed + n_input} in the prompt and "
                           f"session, {max_tokens} to generate)", "max_tokens",
                           "context_length_exceeded")
        need = total * self.info.state_bytes_per_token
        if self.state_budget and need > self.state_budget:
            raise APIError(400, f"this request's KV cache would need {need:,} bytes at "
                           f"{total} tokens; the server's --max-memory leaves "
                           f"{self.state_budget:,} for all of them", "max_tokens",
                           "context_length_exceeded")

    # ---- running requests ----------------------------------------------------------------
    async def start(self, prep: Prepared) -> RequestHandle:
        """Submit a request (continuing its session, if any); returns its handle."""
        self._check_open()
        named = self.named_state(prep.state_name, prep.session_id)
        if named is not None:
            self._check_stateless(prep)
            return self._submit(self._request(prep, prep.prompt_ids, named))
        if prep.session_id is None:
            self._check_stateless(prep)
            if self.next_turns is not None:
                await self.next_turns.settled(prep.prompt_ids)
            req = GenerationRequest(new_id("cmpl"), prep.prompt_ids, prep.params, prep.stop,
                                    prompt_logprobs=prep.prompt_logprobs, chat=prep.chat,
                                    fault=prep.fault, grammar=prep.grammar,
                                    keep_at=prep.keep_at, inserts=prep.inserts)
            if self.remote is not None and not prep.prompt_logprobs:
                hint = await self.remote.lookup(prep.prompt_ids, len(prep.prompt_ids) - 1)
                if hint is not None:
                    req.prefix_depth, req.prefix_blob = hint
            return self._submit(req)
        return await self._start_in_session(prep)

    def named_state(self, name: str | None, session_id: str | None = None
                    ) -> StateBlob | None:
        """The named initial state a request asks for (None: none asked); 400 for a name
        the server does not hold, or one asked with a session (which has its own state)."""
        if name is None:
            return None
        if session_id is not None:
            raise APIError(400, "state and session_id cannot be given together: a session "
                           "continues from its own state", "state")
        found = self.named_states.get(name)
        if found is None:
            held = ", ".join(sorted(self.named_states)) or "none; see --state-dir"
            raise APIError(400, f"no state named {name!r} (this server holds: {held})",
                           "state", "state_not_found")
        return found.state

    def _request(self, prep: Prepared, feed: list[int], start: StateBlob | None,
                 start_tokens: int = 0, seed_offset: int | None = None) -> GenerationRequest:
        """A request for ``prep`` feeding ``feed`` after ``start`` (sample ``seed_offset``
        of n, its seed moved by that much where one is given)."""
        params = prep.params
        if seed_offset is not None and params.seed is not None:
            params = replace(params, seed=params.seed + seed_offset)
        return GenerationRequest(new_id("cmpl"), feed, params, prep.stop, start_blob=start,
                                 start_tokens=start_tokens,
                                 prompt_logprobs=prep.prompt_logprobs, chat=prep.chat,
                                 fault=prep.fault, grammar=prep.grammar, inserts=prep.inserts)

    def _check_open(self) -> None:
        if self.draining():
            raise APIError(503, "server is shutting down", None, "shutting_down",
                           OVERLOADED_HEADERS)

    def _check_stateless(self, prep: Prepared) -> None:
        """A request without a session needs a prompt, within the model's context."""
        if not prep.prompt_ids:
            raise APIError(400, "prompt must not be empty without a session_id", "prompt")
        self._check_context(0, len(prep.prompt_ids), prep.params.max_tokens)

    async def start_choices(self, prep: Prepared, n: int) -> list[RequestHandle]:
        """``n`` samples of one prompt, each its own request with seed + j (when a seed is
        given). For n > 1 the prompt is prefilled once (a prefill-only request, which the
        prefix cache also serves) and every choice starts from that state with only the
        last prompt token to feed: the fork is a shared immutable state, O(1) per choice."""
        if n == 1:
            return [await self.start(prep)]
        if prep.session_id is not None:
            try:
                known = await self.store.get(prep.session_id, prep.owner) is not None
            except SessionUnavailable as exc:
                raise APIError(503, "session store unavailable", "session_id") from exc
            if not known:
                raise APIError(404, f"session {prep.session_id!r} not found", "session_id")
            raise APIError(400, "n > 1 cannot continue a session (which choice would it "
                           "keep?); use n = 1 or fork the session", "n")
        self._check_open()
        self._check_stateless(prep)
        ids = prep.prompt_ids
        base: StateBlob | None = self.named_state(prep.state_name, prep.session_id)
        feed, cached = ids, 0
        if len(ids) > 1 and not prep.prompt_logprobs and base is None and not prep.inserts:
            if self.next_turns is not None:
                await self.next_turns.settled(ids)
            base, feed, cached = await self._prefill(ids)
        handles: list[RequestHandle] = []
        try:
            for j in range(n):
                req = self._request(prep, feed, base, len(ids) - len(feed), j)
                handles.append(self._submit(req))
                handles[-1].forked_from = cached
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    async def _start_in_session(self, prep: Prepared) -> RequestHandle:
        assert prep.session_id is not None
        sid = prep.session_id
        sess, token = await self.lock_session(sid, prep.owner)
        try:
            if prep.turn is not None and prep.turn.version != sess.version:
                raise APIError(409, f"session {sid!r} changed while this request was read; "
                               "send it again", "session_id", "session_busy")
            input_ids = sess.pending + prep.prompt_ids
            if not input_ids:
                raise APIError(400, "the session is empty; give a prompt", "prompt")
            consumed = sess.tokens - len(sess.pending)
            self._check_context(consumed, len(input_ids), prep.params.max_tokens)
            req = GenerationRequest(new_id("cmpl"), input_ids, prep.params, prep.stop,
                                    start_blob=sess.state, start_tokens=consumed,
                                    prompt_logprobs=prep.prompt_logprobs,
                                    want_state=prep.turn is None,
                                    chat=prep.chat, fault=prep.fault, grammar=prep.grammar,
                                    inserts=prep.inserts)
            handle = self._submit(req)
        except BaseException:
            await self.store.release(sid, token)
            raise
        handle.saved = asyncio.get_running_loop().create_future()

        def save(out: Output) -> None:
            self.spawn(self._save(sess, token, out, handle, prep))

        handle.on_finish(save)
        return handle

    async def lock_session(self, sid: str, owner: str) -> tuple[Session, str]:
        """Take a session's busy-lock and read it: 404 unknown/foreign, 409 busy."""
        try:
            token = await self.store.acquire(sid)
            if token is None:
                if await self.store.get(sid, owner) is None:
                    raise APIError(404, f"session {sid!r} not found", "session_id")
                raise APIError(409, f"session {sid!r} is busy with another request",
                               "session_id", "session_busy")
            sess = await self.store.get(sid, owner)
        except SessionUnavailable as exc:
            raise APIError(503, "session store unavailable", "session_id") from exc
        if sess is None:
            await self.store.release(sid, token)
            raise APIError(404, f"session {sid!r} not found", "session_id")
        return sess, token

    async def delete_session(self, sid: str, owner: str, param: str = "session_id") -> None:
        """Delete a session: 404 unknown, 409 while a request runs on it (cancel that one
        first), so an in-flight save can never bring a deleted session back."""
        _, token = await self.lock_session(sid, owner)
        try:
            await self.store.delete(sid, owner)
        except SessionUnavailable as exc:
            raise APIError(503, "session store unavailable", param) from exc
        finally:
            await self.store.release(sid, token)

    def _submit(self, req: GenerationRequest) -> RequestHandle:
        try:
            return self.client.submit(req)
        except Overloaded as exc:
            raise APIError(429, "server is at capacity; retry later", None, "overloaded",
                           OVERLOADED_HEADERS) from exc
        except EngineUnavailable as exc:
            raise APIError(503, f"the engine is unavailable ({exc}); retry shortly", None,
                           "engine_unavailable", OVERLOADED_HEADERS) from exc

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` in the background, held until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _save(self, sess: Session, token: str, out: Output,
                    handle: RequestHandle, prep: Prepared) -> None:
        """Store the session's new state (if the request produced one) and its ``meta``,
        then unlock."""
        ok = True
        try:
            new = await self._next_session(sess, out, handle, prep.turn)
            if prep.meta is not None:
                new = replace(new or sess, meta=prep.meta(handle.text, out))
            if new is not None:
                await self.store.put(new)
        except (StaleWrite, SessionUnavailable, APIError):
            log.warning("session %s could not be saved", sess.id)
            ok = False
        finally:
            await self.store.release(sess.id, token)
            if handle.saved is not None and not handle.saved.done():
                handle.saved.set_result(ok)

    async def _next_session(self, sess: Session, out: Output, handle: RequestHandle,
                            turn: ChatTurn | None) -> Session | None:
        """The session after this request (None: it keeps what it holds)."""
        if turn is not None:
            if out.finish_reason in ("cancelled", "error"):
                return None
            return await self._after_turn(sess, turn, handle.text)
        if out.final_blob is None:
            return None
        return Session(sess.id, sess.owner, out.final_blob, out.final_pending,
                       out.final_tokens, sess.created, time.time(), sess.version,
                       meta=sess.meta)

    async def collect(self, handle: RequestHandle) -> Output:
        """Wait for the whole result (non-streaming); a failed request raises its error
        (never a 200 carrying an error)."""
        total = Output()
        while True:
            out = await handle.next()
            assert out is not None
            total = total.merge(out)
            if out.error is not None:
                raise engine_error(out)
            if out.finish_reason is not None:
                if handle.saved is not None and not await handle.saved:
                    raise APIError(503, STORE_FAILED, "session_id", "session_store_failed")
                return total

    async def _after_turn(self, sess: Session, turn: ChatTurn, reply: str) -> Session:
        """A template chat session after a reply: its previous state (read again, as stored)
        with the text the template renders of the turn prefilled (see
        :mod:`linserve.server.api.chat_session`)."""
        assert self.chat is not None
        transcript = turn.after(self.chat, self.tok.special_tokens(), reply)
        feed = self.tok.encode(transcript.text[len(turn.conversation.text):])
        old = await self.store.get(sess.id, sess.owner)
        if old is None:
            raise SessionUnavailable(sess.id)
        self._check_context(old.tokens, len(feed), 0)
        consumed = old.tokens - len(old.pending)
        state, pending, _ = await self._prefill(old.pending + feed, old.state, consumed)
        return Session(sess.id, sess.owner, state, pending, old.tokens + len(feed),
                       sess.created, time.time(), sess.version, transcript.to_json(), old.meta)

    # ---- sessions ------------------------------------------------------------------------
    async def build_state(self, prompt_ids: list[int]) -> tuple[StateBlob, list[int]]:
        """Prefill ``prompt_ids`` in the engine (no sampling): the state and pending tokens."""
        state, pending, _ = await self._prefill(prompt_ids)
        return state, pending

    async def _prefill(self, prompt_ids: list[int], start: StateBlob | None = None,
                       start_tokens: int = 0) -> tuple[StateBlob, list[int], int]:
        """A prefill-only request (after ``start``, which holds ``start_tokens``): the state,
        the pending tokens, and how many prompt tokens the prefix cache served."""
        out = await self._run_prefill(GenerationRequest(
            new_id("prefill"), prompt_ids, SamplingParams(max_tokens=0), want_state=True,
            start_blob=start, start_tokens=start_tokens))
        if out.final_blob is None:
            raise APIError(503, "engine could not build the session state", None)
        return out.final_blob, out.final_pending, out.cached_tokens

    async def warm(self, prompt_ids: list[int], kind: str,
                   inserts: tuple[Insert, ...] = ()) -> None:
        """Prefill ``prompt_ids`` (with the images ``inserts`` places) into the engine's
        prefix cache only: the state stays there (not sent back, which for a long
        conversation's KV is megabytes); ``kind`` names it in the prompt-token counters."""
        await self._run_prefill(GenerationRequest(
            new_id("prefill"), prompt_ids, SamplingParams(max_tokens=0), kind=kind,
            inserts=inserts))

    async def _run_prefill(self, req: GenerationRequest) -> Output:
        handle = self._submit(req)
        try:
            return await self.collect(handle)
        except asyncio.CancelledError:  # nobody waits for it any more: stop it in the engine
            handle.cancel()
            raise

    async def create_session(self, owner: str, prompt_ids: list[int],
                             state_name: str | None = None) -> Session:
        """A new session of ``prompt_ids`` prefilled, from the named state if given."""
        self._check_context(0, len(prompt_ids), 0)
        start = self.named_state(state_name)
        pending: list[int] = []
        if start is not None and not prompt_ids:
            state = start  # blobs are immutable: the session shares it
        else:
            state, pending, _ = await self._prefill(prompt_ids, start)
        sess = Session(new_session_id(), owner, state, pending, len(prompt_ids))
        return await self.put_new(sess)

    async def put_new(self, sess: Session) -> Session:
        try:
            return await self.store.put(sess)
        except SessionUnavailable as exc:
            raise APIError(503, "session store unavailable", None) from exc
