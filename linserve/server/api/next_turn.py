"""The next turn of a conversation resent whole, put in the prefix cache ahead of time.

After a stateless chat reply with a checkpoint's template, the text the template will
render of the conversation and that reply on the next turn (:func:`next_turn_texts`: one
per kind of next turn, a user message or, after tool calls, their results) is tokenized as
the next request will tokenize it and prefilled by a prefill-only request, whose state the
engine's prefix cache keeps. The engine's own entry after a generation holds the reply as
the model wrote it, which a template renders differently (without its reasoning, with its
end tokens), so without this the next turn resumes only from the previous prompt.

A client that sends its next turn at once (an agent running a tool instantly) would race
that prefill: a request whose prompt extends a conversation being prefilled waits for it
(:meth:`NextTurns.settled`), then takes the cached state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from linserve.server.api.chat_session import Transcript, next_turn_texts
from linserve.server.api.chat_template import TemplateChat
from linserve.server.api.errors import APIError
from linserve.server.engine.client import RequestHandle
from linserve.server.engine.types import Output

log = logging.getLogger("linserve.service")
SETTLE_SECONDS = 60.0  # the longest a request waits for a conversation's prefill


class NextTurns:
    """Prefills of remembered conversations, and the requests that wait for them."""

    def __init__(self, chat: TemplateChat, specials: Sequence[str],
                 encode: Callable[[str], list[int]],
                 prefill: Callable[[list[int]], Coroutine[Any, Any, object]],
                 spawn: Callable[[Coroutine[Any, Any, None]], None], max_tokens: int) -> None:
        self.chat, self.specials, self.encode = chat, specials, encode
        self.prefill, self.spawn, self.max_tokens = prefill, spawn, max_tokens
        self.running: list[tuple[list[int], asyncio.Future[None]]] = []

    def remember(self, handle: RequestHandle, messages: list[dict[str, Any]],
                 render: dict[str, Any], reply: Callable[[str], dict[str, Any]]) -> None:
        """When ``handle`` (a stateless reply to ``messages``) finishes whole, prefill the
        conversation as its next turn will render it. Registered as the reply ends, before
        its client can send the next turn."""
        def done(out: Output) -> None:
            if out.finish_reason not in ("stop", "length"):
                return
            for ids in self._next_ids(messages, render, reply(handle.text)):
                if len(handle.req.input_ids) < len(ids) <= self.max_tokens:
                    future = asyncio.get_running_loop().create_future()
                    self.running.append((ids, future))
                    self.spawn(self._prefill(ids, future))

        handle.on_finish(done)

    def _next_ids(self, messages: list[dict[str, Any]], render: dict[str, Any],
                  reply: dict[str, Any]) -> list[list[int]]:
        try:
            texts = next_turn_texts(self.chat, Transcript(messages, ""), reply,
                                    self.specials, **render)
        except (APIError, ValueError) as exc:  # a template that will not render it
            log.debug("next turn not cached: %s", exc)
            return []
        return [self.encode(text) for text in texts]

    async def _prefill(self, ids: list[int], future: asyncio.Future[None]) -> None:
        try:
            await self.prefill(ids)
        except APIError as exc:  # the engine is busy or down: no entry, no harm
            log.debug("next turn not cached: %s", exc.message)
        finally:
            self.running.remove((ids, future))
            future.set_result(None)

    async def settled(self, prompt_ids: list[int]) -> None:
        """Wait until no remembered conversation that ``prompt_ids`` extends is still being
        prefilled (at most ``SETTLE_SECONDS``)."""
        waits = [future for ids, future in self.running
                 if len(ids) <= len(prompt_ids) and prompt_ids[:len(ids)] == ids]
        if waits:
            await asyncio.wait([asyncio.shield(f) for f in waits], timeout=SETTLE_SECONDS)
