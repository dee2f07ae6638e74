"""The next turn of a conversation resent whole, put in the prefix cache ahead of time.

After a stateless chat reply with a checkpoint's template, the text the template will
render of the conversation and that reply on the next turn (:func:`next_turn_texts`: one
per kind of next turn, a user message or, after tool calls, their results) is tokenized as
the next request will tokenize it and prefilled by a prefill-only request, whose state the
engine's prefix cache keeps. The engine's own entry after a generation holds the reply as
the model wrote it, which a template renders differently (without its reasoning, with its
end tokens), so without this the next turn resumes only from the previous prompt.

That prefill resumes where the next rendering leaves the previous prompt: the start of its
generation prompt (``<|im_start|>assistant\n`` and, thinking off, ``<think>\n\n</think>\n\n``),
which the rendered history replaces with the reply's own header. A recurrent state cannot
step back there, so the previous prompt's prefill keeps one (:meth:`NextTurns.boundary`,
the request's ``keep_at``): the prefill then runs only the reply as re-rendered and the next
turn's header, not the last user message again.

A client that sends its next turn at once (an agent running a tool instantly) would race
that prefill: a request whose prompt extends a conversation being prefilled waits for it
(:meth:`NextTurns.settled`), then takes the cached state; the prefills of the other kinds
of next turn (a user message where tool results came) are cancelled, so it never waits
behind tokens it does not need.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from linserve.model.inputs import Insert
from linserve.server.api.chat_session import Transcript, next_turn_texts
from linserve.server.api.chat_template import TemplateChat
from linserve.server.api.errors import APIError
from linserve.server.api.protocol import ChatMessage
from linserve.server.engine.client import RequestHandle
from linserve.server.engine.types import Output
from linserve.server.sessions.transcript import common_prefix

log = logging.getLogger("linserve.service")
# How a request's images go into a rendering's ids: placeholders expanded, items made
# (server.api.images.place with the request's images).
Place = Callable[[list[int]], tuple[list[int], tuple[Insert, ...]]]
SETTLE_SECONDS = 60.0  # the longest a request waits for a conversation's prefill


@dataclass(eq=False)
class _Prefill:
    """One remembered conversation's prefill in flight; ``group``: the reply it follows (the
    kinds of next turn of one reply share it)."""

    ids: list[int]
    group: int
    done: asyncio.Future[None]
    task: asyncio.Task[None] | None = None
    inserts: tuple[Insert, ...] = ()  # its images (placed by the remembered request's own)


class NextTurns:
    """Prefills of remembered conversations, and the requests that wait for them."""

    def __init__(self, chat: TemplateChat, specials: Sequence[str],
                 encode: Callable[[str], list[int]],
                 prefill: Callable[[list[int], tuple[Insert, ...]],
                                   Coroutine[Any, Any, object]],
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
                 max_tokens: int) -> None:
        self.chat, self.specials, self.encode = chat, specials, encode
        self.prefill, self.spawn, self.max_tokens = prefill, spawn, max_tokens
        self.running: list[_Prefill] = []
        self.preparing: list[asyncio.Future[None]] = []  # conversations being rendered
        self._groups = itertools.count()

    def boundary(self, messages: Sequence[ChatMessage], render: dict[str, Any],
                 prompt_ids: list[int], place: Place | None = None) -> int:
        """Where ``prompt_ids`` (``messages`` rendered with the generation prompt) leave the
        conversation rendered without it: the state to keep for the next turn (0: none).
        ``place``: how the request's images went into its ids."""
        try:
            history = self.encode(self.chat.render(list(messages), False, **render))
            if place is not None:
                history = place(history)[0]
        except (APIError, ValueError):
            return 0
        at = common_prefix(prompt_ids, history)
        return at if 0 < at < len(prompt_ids) else 0

    def remember(self, handle: RequestHandle, messages: list[dict[str, Any]],
                 render: dict[str, Any], reply: Callable[[str], dict[str, Any]],
                 place: Place | None = None) -> None:
        """When ``handle`` (a stateless reply to ``messages``) finishes whole, prefill the
        conversation as its next turn will render it. Registered as the reply ends, before
        its client can send the next turn; the rendering and tokenizing (a long
        conversation, once per kind of next turn) run in a thread, and a request that
        arrives meanwhile waits for them (:meth:`settled`)."""
        def done(out: Output) -> None:
            if out.finish_reason not in ("stop", "length"):
                return
            group = next(self._groups)
            ready = asyncio.get_running_loop().create_future()
            self.preparing.append(ready)
            self.spawn(self._start(group, ready, messages, render, reply(handle.text),
                                   len(handle.req.input_ids), place))

        handle.on_finish(done)

    async def _start(self, group: int, ready: asyncio.Future[None],
                     messages: list[dict[str, Any]], render: dict[str, Any],
                     reply: dict[str, Any], prompt_len: int, place: Place | None) -> None:
        try:
            texts = await asyncio.to_thread(self._next_ids, messages, render, reply, place)
            for ids, inserts in texts:
                if prompt_len < len(ids) <= self.max_tokens:
                    run = _Prefill(ids, group, asyncio.get_running_loop().create_future(),
                                   inserts=inserts)
                    self.running.append(run)
                    run.task = self.spawn(self._prefill(run))
        finally:
            self.preparing.remove(ready)
            ready.set_result(None)

    def _next_ids(self, messages: list[dict[str, Any]], render: dict[str, Any],
                  reply: dict[str, Any], place: Place | None
                  ) -> list[tuple[list[int], tuple[Insert, ...]]]:
        try:
            texts = next_turn_texts(self.chat, Transcript(messages, ""), reply,
                                    self.specials, **render)
            ids = [self.encode(text) for text in texts]
            return [place(x) if place is not None else (x, ()) for x in ids]
        except (APIError, ValueError) as exc:  # a template that will not render it
            log.debug("next turn not cached: %s", exc)
            return []

    async def _prefill(self, run: _Prefill) -> None:
        try:
            await self.prefill(run.ids, run.inserts)
        except APIError as exc:  # the engine is busy or down: no entry, no harm
            log.debug("next turn not cached: %s", exc.message)
        except asyncio.CancelledError:  # the next turn came, and it is another kind
            log.debug("next turn prefill of %d tokens cancelled", len(run.ids))
        finally:
            self.running.remove(run)
            run.done.set_result(None)

    async def settled(self, prompt_ids: list[int]) -> None:
        """Wait until no remembered conversation that ``prompt_ids`` extends is still being
        prefilled (at most ``SETTLE_SECONDS``): the part it shares is computed once. The
        prefills of the same reply's other kinds of next turn, which it does not extend,
        are cancelled rather than waited behind."""
        if self.preparing:  # rendered in a moment: then it is known which to wait for
            await asyncio.wait([asyncio.shield(f) for f in self.preparing],
                               timeout=SETTLE_SECONDS)
        waits = [run for run in self.running
                 if len(run.ids) <= len(prompt_ids) and prompt_ids[:len(run.ids)] == run.ids]
        groups = {run.group for run in waits}
        for run in self.running:
            if run.group in groups and run not in waits and run.task is not None:
                run.task.cancel()
        if waits:
            await asyncio.wait([asyncio.shield(run.done) for run in waits],
                               timeout=SETTLE_SECONDS)
