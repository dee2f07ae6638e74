"""Sessions: a constant-size recurrent state (or a KV cache for the baseline) per
conversation, owned by the API key that created it.

A session holds the state after every token but the ``pending`` ones, which the next request
feeds first. :class:`SessionStore` is the interface; :class:`MemorySessionStore` (the
default) is an LRU with a byte budget and TTL. ``linserve.server.sessions.redis_store`` shares
sessions between replicas.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from linserve.model.blob_view import PackedBlob, StateBlob
from linserve.model.info import ModelInfo
from linserve.server import metrics


def owner_hash(api_key: str | None) -> str:
    """Stable, non-reversible owner id for an API key ('' for an open server)."""
    return "" if not api_key else hashlib.sha256(api_key.encode()).hexdigest()[:32]


def new_session_id() -> str:
    """192 random bits, URL-safe: unguessable and not enumerable."""
    return "sess_" + secrets.token_urlsafe(24)


@dataclass
class Session:
    id: str
    owner: str
    state: StateBlob  # its blob, as the engine wrote it
    pending: list[int]
    tokens: int  # every token of the session, pending included
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    version: int = 0
    # A chat session with a checkpoint's template: the conversation and the rendered text
    # the state covers (server.api.chat_session.Transcript); None for any other session.
    chat: dict[str, Any] | None = None
    # What an API keeps with the state: a stored Responses-API response (its object and
    # input items, server.api.responses.stored); None for a plain session.
    meta: dict[str, Any] | None = None

    @property
    def state_bytes(self) -> int:
        return self.state.nbytes


def session_problem(state: StateBlob, tokens: object, pending: object, info: ModelInfo
                    ) -> str | None:
    """Why a session's metadata cannot go with its state (None if it can): one row, a token
    count that covers the pending tokens, pending ids in the vocabulary, and a state whose
    length is the tokens consumed, within the model's context."""
    if state.rows != 1:
        return "a session state has exactly one row"
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return "'tokens' must be a non-negative integer"
    if not isinstance(pending, list) or len(pending) > 1 or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < info.vocab_size
            for t in pending):
        return "'pending' must be a list of at most one token id in the vocabulary"
    if tokens < len(pending):
        return "'tokens' is smaller than the pending tokens"
    cached = state.tokens
    if cached != tokens - len(pending):
        return (f"the state holds {cached} positions but the session says "
                f"{tokens - len(pending)} tokens were consumed")
    limit = info.context_limit
    if limit is not None and tokens > limit:
        return f"the session has {tokens} tokens; the model's context is {limit}"
    return None


# What a stored session's ``state`` field holds while the real state is compressed: an
# empty state, so no tensors of the session stay alive twice.
_PLACEHOLDER = StateBlob(b"")


class SessionUnavailable(Exception):
    """The backing store cannot be reached (answer 503)."""


class StaleWrite(Exception):
    """A newer version of the session was written by someone else."""


class SessionStore(abc.ABC):
    """Async interface shared by the memory and Redis stores."""

    @abc.abstractmethod
    async def get(self, session_id: str, owner: str) -> Session | None:
        """The session if it exists and belongs to ``owner`` (else None: answer 404)."""

    @abc.abstractmethod
    async def put(self, session: Session) -> Session:
        """Write a new version (``session.version`` is the one it was read at)."""

    @abc.abstractmethod
    async def delete(self, session_id: str, owner: str) -> bool: ...

    @abc.abstractmethod
    async def acquire(self, session_id: str) -> str | None:
        """Mark busy; returns a lock token, or None if already busy (answer 409)."""

    @abc.abstractmethod
    async def release(self, session_id: str, token: str) -> None: ...

    @abc.abstractmethod
    async def busy(self, session_id: str) -> bool:
        """Whether a request holds the session's busy-lock now."""

    @abc.abstractmethod
    async def stats(self) -> tuple[int, int]:
        """(number of sessions, bytes of state)."""

    async def status(self, session_id: str, owner: str) -> tuple[Session | None, bool]:
        """The session and whether a request holds it, as one consistent answer.

        The lock is read first: a request saves its session and then releases the lock, so
        a session read after "not busy" is the saved one. Read the other way round, a save
        that lands between the two reads reports the old session as free."""
        busy = await self.busy(session_id)
        return await self.get(session_id, owner), busy

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        return None


@dataclass
class _Stored:
    """A session at rest in the memory store: its fields, with the state compressed
    losslessly (:meth:`StateBlob.pack`, ~90% of the raw fp32 bytes)."""

    session: Session  # every field but ``state`` is current; the state lives in ``packed``
    packed: PackedBlob

    @property
    def state_bytes(self) -> int:
        return self.packed.nbytes

    def restore(self) -> Session:
        return replace(self.session, state=self.packed.unpack())


class MemorySessionStore(SessionStore):
    """In-process LRU of sessions with a byte budget and an idle TTL. States are held
    compressed and restored bit for bit on ``get``; the budget counts compressed bytes."""

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._locks: dict[str, str] = {}
        self._bytes = 0
        self._mutex = asyncio.Lock()

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl
        for sid in [s for s, st in self._items.items() if st.session.last_used < cutoff]:
            if sid not in self._locks:
                self._drop(sid)

    def _drop(self, sid: str) -> None:
        sess = self._items.pop(sid, None)
        if sess is not None:
            self._bytes -= sess.state_bytes

    def _evict_for(self, incoming: int) -> None:
        for sid in list(self._items):
            if self._bytes + incoming <= self.max_bytes:
                return
            if sid not in self._locks:
                self._drop(sid)

    def _publish(self) -> None:
        metrics.SESSIONS.set(len(self._items))
        metrics.SESSION_BYTES.set(self._bytes)

    async def get(self, session_id: str, owner: str) -> Session | None:
        stored = self._items.get(session_id)
        if stored is None or stored.session.owner != owner:
            return None
        if stored.session.last_used < time.time() - self.ttl and session_id not in self._locks:
            self._drop(session_id)
            self._publish()
            return None
        self._items.move_to_end(session_id)
        return await asyncio.to_thread(stored.restore)

    async def put(self, session: Session) -> Session:
        packed = await asyncio.to_thread(session.state.pack)
        async with self._mutex:
            old = self._items.get(session.id)
            if old is not None and old.session.version != session.version:
                raise StaleWrite(session.id)
            done = replace(session, version=session.version + 1, last_used=time.time())
            stored = _Stored(replace(done, state=_PLACEHOLDER), packed)
            self._drop(session.id)
            self._expire()
            self._evict_for(stored.state_bytes)
            self._items[session.id] = stored
            self._bytes += stored.state_bytes
            self._publish()
            return done

    async def delete(self, session_id: str, owner: str) -> bool:
        stored = self._items.get(session_id)
        if stored is None or stored.session.owner != owner:
            return False
        self._drop(session_id)
        self._locks.pop(session_id, None)
        self._publish()
        return True

    async def acquire(self, session_id: str) -> str | None:
        if session_id in self._locks:
            return None
        token = secrets.token_hex(8)
        self._locks[session_id] = token
        return token

    async def release(self, session_id: str, token: str) -> None:
        if self._locks.get(session_id) == token:
            del self._locks[session_id]

    async def busy(self, session_id: str) -> bool:
        return session_id in self._locks

    async def stats(self) -> tuple[int, int]:
        return len(self._items), self._bytes
