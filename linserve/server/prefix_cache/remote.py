"""Prefix states shared between replicas through Redis (the HTTP process's side).

The engine publishes the states it caches at prompt ends, generation ends and branch points
(not the periodic ones inside long prefills); this process writes them to Redis under a TTL
and a per-entry size cap. For a request without a ``session_id`` it looks up the deepest
published prefix of the prompt and, when this replica did not publish that entry itself
(its own engine then holds it already), fetches the state and hands it to the engine as a
hint; the engine takes whichever is deeper, the hint or its local hit.

Layout: ``{prefix}pfx:{h}`` holds a state blob (the export format), ``h`` the SHA-256 of the
model fingerprint and the token ids; ``{prefix}pfxroot:{r}`` is a sorted set of the entry
hashes under one conversation root ``r`` (the first ``ROOT_TOKENS`` tokens), scored by depth.
A lookup is two round trips: the root's members up to the depth allowed, then one GET.

Redis down or slow: every call is bounded (``timeout``) and any failure only means no remote
hit; a stateless request never fails because of Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from linserve.server import metrics

log = logging.getLogger("linserve.prefix")
ROOT_TOKENS = 32  # entries shorter than this are not worth a remote fetch
MAX_CANDIDATES = 64


class RemotePrefixes:
    def __init__(self, url: str, fingerprint: str, ttl: float, max_entry_bytes: int,
                 prefix: str = "linserve:", timeout: float = 0.25) -> None:
        self.redis = aioredis.from_url(url, socket_timeout=timeout,
                                       socket_connect_timeout=timeout)
        self.fingerprint = fingerprint.encode()
        self.ttl_ms = int(ttl * 1000)
        self.max_entry_bytes = max_entry_bytes
        self.prefix, self.timeout = prefix, timeout
        self.published: OrderedDict[str, None] = OrderedDict()  # hashes this replica wrote
        self._tasks: set[asyncio.Task[None]] = set()

    def digest(self, tokens: Sequence[int]) -> str:
        return hashlib.sha256(self.fingerprint + array("q", tokens).tobytes()).hexdigest()[:32]

    def _root(self, tokens: Sequence[int]) -> str:
        return f"{self.prefix}pfxroot:{self.digest(tokens[:ROOT_TOKENS])}"

    def publish_soon(self, tokens: list[int], blob: bytes) -> None:
        """Called from the event loop for each state the engine publishes."""
        if len(tokens) < ROOT_TOKENS or len(blob) > self.max_entry_bytes:
            return
        task = asyncio.ensure_future(self._publish(tokens, blob))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, tokens: list[int], blob: bytes) -> None:
        h = self.digest(tokens)
        root = self._root(tokens)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(f"{self.prefix}pfx:{h}", blob, px=self.ttl_ms)
            pipe.zadd(root, {h: len(tokens)})
            pipe.pexpire(root, self.ttl_ms)
            await asyncio.wait_for(pipe.execute(), self.timeout * 4)
        except (RedisError, OSError, TimeoutError) as exc:
            metrics.PREFIX_REMOTE_ERRORS.inc()
            log.debug("prefix publish failed: %s", exc)
            return
        self.published[h] = None
        while len(self.published) > 100_000:
            self.published.popitem(last=False)

    async def lookup(self, tokens: Sequence[int], limit: int) -> tuple[int, bytes] | None:
        """The deepest published prefix of ``tokens`` (depth ≤ ``limit``) that this
        replica did not publish: ``(depth, blob)``, or None."""
        if len(tokens) <= ROOT_TOKENS:
            return None
        try:
            return await asyncio.wait_for(self._lookup(tokens, limit), self.timeout * 4)
        except (RedisError, OSError, TimeoutError) as exc:
            metrics.PREFIX_REMOTE_ERRORS.inc()
            log.debug("prefix lookup failed: %s", exc)
            return None

    async def _lookup(self, tokens: Sequence[int], limit: int) -> tuple[int, bytes] | None:
        members: Any = await self.redis.zrevrangebyscore(
            self._root(tokens), limit, ROOT_TOKENS, start=0, num=MAX_CANDIDATES,
            withscores=True)
        for member, score in members:
            h, depth = member.decode(), int(score)
            if self.digest(tokens[:depth]) != h:
                continue
            if h in self.published:
                return None  # ours: the local engine holds it (or something as deep)
            blob: Any = await self.redis.get(f"{self.prefix}pfx:{h}")
            if blob is not None:
                metrics.PREFIX_REMOTE_FETCHES.inc()
                metrics.PREFIX_REMOTE_FETCH_BYTES.inc(len(blob))
                return depth, bytes(blob)
        return None

    async def close(self) -> None:
        await self.redis.aclose()
