"""Sessions in Redis, shared by every replica.

Each session is a hash ``{prefix}sess:{id}`` with the state as safetensors bytes (the export
format) beside its metadata: owner hash, token count, pending tokens, model fingerprint,
format version, timestamps and a write version. Keys expire after the TTL, refreshed on use.

- Busy-lock: redis-py's ``Lock`` on ``{prefix}lock:{id}`` (``SET NX PX`` with a random token,
  atomic token-checked renewal and release), so two replicas can never advance one session
  at once.
- Versioned writes: a Lua script writes only if the stored version is the one the writer
  read, so a stale replica cannot overwrite a newer state.
- Redis down: every call raises :class:`SessionUnavailable` (answered with 503); the client
  reconnects by itself when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError, RedisError

from linserve.model.blob_view import StateBlob
from linserve.model.info import STATE_FORMAT_VERSION, StateError
from linserve.server.sessions.store import Session, SessionStore, SessionUnavailable, StaleWrite

_PUT = """
local cur = redis.call('HGET', KEYS[1], 'version')
if (cur == false and ARGV[1] ~= '0') or (cur ~= false and cur ~= ARGV[1]) then
  return -1
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class RedisSessionStore(SessionStore):
    def __init__(self, url: str, ttl: float, lock_seconds: float = 10.0,
                 prefix: str = "linserve:") -> None:
        self.redis = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                       retry_on_timeout=False)
        self.ttl_ms = int(ttl * 1000)
        self.lock_ms = int(lock_seconds * 1000)
        self._renewers: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, Lock] = {}
        self.prefix = prefix
        self.fingerprint = ""
        self._put = self.redis.register_script(_PUT)

    def bind_model(self, fingerprint: str) -> None:
        """Sessions are this model's (its ``fingerprint``); others' sessions are invisible."""
        self.fingerprint = fingerprint

    def _key(self, sid: str) -> str:
        return f"{self.prefix}sess:{sid}"

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise SessionUnavailable(str(exc)) from exc

    async def get(self, session_id: str, owner: str) -> Session | None:
        key = self._key(session_id)
        data: dict[bytes, bytes] = await self._call(self.redis.hgetall(key))
        if not data or data.get(b"owner", b"").decode() != owner:
            return None
        if data.get(b"fingerprint", b"").decode() != self.fingerprint or not self.fingerprint:
            return None
        try:  # the engine validates the tensors when it runs the state
            state = StateBlob(data[b"state"])
            if state.fingerprint != self.fingerprint:
                return None
        except (StateError, KeyError):
            return None
        await self._call(self.redis.pexpire(key, self.ttl_ms))
        chat = json.loads(data[b"chat"]) if data.get(b"chat") else None
        meta = json.loads(data[b"meta"]) if data.get(b"meta") else None
        return Session(session_id, owner, state, json.loads(data[b"pending"]),
                       int(data[b"tokens"]), float(data[b"created"]), float(data[b"last_used"]),
                       int(data[b"version"]), chat, meta)

    async def put(self, session: Session) -> Session:
        assert self.fingerprint, "bind_model first"
        blob = session.state.data
        now = time.time()
        new_version = session.version + 1
        fields: list[Any] = [
            "state", blob, "owner", session.owner, "tokens", session.tokens,
            "pending", json.dumps(session.pending), "created", session.created,
            "last_used", now, "version", new_version, "fingerprint", self.fingerprint,
            "format_version", STATE_FORMAT_VERSION,
            "chat", json.dumps(session.chat) if session.chat is not None else "",
            "meta", json.dumps(session.meta) if session.meta is not None else ""]
        ok = await self._call(self._put(keys=[self._key(session.id)],
                                        args=[session.version, self.ttl_ms, *fields]))
        if ok != 1:
            raise StaleWrite(session.id)
        return Session(session.id, session.owner, session.state, session.pending,
                       session.tokens, session.created, now, new_version, session.chat,
                       session.meta)

    async def delete(self, session_id: str, owner: str) -> bool:
        key = self._key(session_id)
        stored = await self._call(self.redis.hget(key, "owner"))
        if stored is None or stored.decode() != owner:
            return False
        return bool(await self._call(self.redis.delete(key)))

    async def acquire(self, session_id: str) -> str | None:
        """The lock lives ``lock_seconds`` and is renewed while held (redis-py's ``Lock``:
        atomic token-checked extend and release), so a replica that dies mid-request frees
        the session within that time."""
        lock = Lock(self.redis, f"{self.prefix}lock:{session_id}",
                    timeout=self.lock_ms / 1000, blocking=False)
        if not await self._call(lock.acquire(blocking=False)):
            return None
        token = secrets.token_hex(16)
        self._locks[token] = lock
        self._renewers[token] = asyncio.create_task(self._renew(lock))
        return token

    async def busy(self, session_id: str) -> bool:
        return bool(await self._call(self.redis.exists(f"{self.prefix}lock:{session_id}")))

    async def _renew(self, lock: Lock) -> None:
        while True:
            await asyncio.sleep(self.lock_ms / 3000)
            try:
                await lock.reacquire()  # resets the TTL only while the token is still ours
            except LockError:
                return
            except (RedisError, OSError):
                continue

    async def release(self, session_id: str, token: str) -> None:
        renewer = self._renewers.pop(token, None)
        if renewer is not None:
            renewer.cancel()
        lock = self._locks.pop(token, None)
        if lock is not None:
            with contextlib.suppress(LockError, RedisError, OSError):  # else it expires
                await lock.release()

    async def stats(self) -> tuple[int, int]:
        count = 0
        async for _ in self.redis.scan_iter(match=f"{self.prefix}sess:*", count=1000):
            count += 1
        return count, -1

    async def healthy(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.redis.ping(), 1.0))
        except (RedisError, OSError, TimeoutError):
            return False

    async def close(self) -> None:
        await self.redis.aclose()
