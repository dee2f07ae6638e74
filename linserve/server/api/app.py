"""The FastAPI application: lifespan (start the engine, which loads the weights once and
warms up), body-size limits, CORS, error handlers and the routers. Torch-free: the model
runs in the engine process (or, in the thread mode, in :mod:`..engine.thread_client`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from linserve.model.heap import trim
from linserve.server.api.errors import body_for, install_error_handlers
from linserve.server.api.openapi import install_openapi
from linserve.server.api.routes import completions, messages, misc, responses, sessions
from linserve.server.api.service import GenerationService
from linserve.server.engine.client import EngineBackend
from linserve.server.engine.description import ModelDescription
from linserve.server.engine.process import ProcessEngineClient
from linserve.server.engine.sizing import engine_threads
from linserve.server.playground.routes import install_playground
from linserve.server.prefix_cache.remote import RemotePrefixes
from linserve.server.sessions.store import MemorySessionStore, SessionStore
from linserve.server.settings import Settings

log = logging.getLogger("linserve")
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


def make_store(settings: Settings) -> SessionStore:
    if settings.session_store == "memory":
        return MemorySessionStore(settings.session_memory_bytes, settings.session_ttl)
    from linserve.server.sessions.redis_store import RedisSessionStore

    return RedisSessionStore(settings.session_store, settings.session_ttl,
                             settings.session_lock_seconds)


class BodyLimit:
    """Pure-ASGI guard: 413 before the app sees a body over its limit. A declared
    Content-Length is checked up front; a chunked body (no Content-Length) is read here up to
    the limit and then replayed to the app, so an oversize one is a 413 too. The state-import
    route allows one full state's bytes."""

    def __init__(self, app: ASGIApp, default: int, large: dict[str, int]) -> None:
        self.app, self.default, self.large = app, default, large

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.large.get(scope["path"], self.default)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > limit:
                await _send_413(send, limit, scope["path"])
                return
            await self.app(scope, receive, send)
            return
        body = await _read_up_to(receive, limit)
        if body is None:
            await _send_413(send, limit, scope["path"])
            return
        await self.app(scope, _replay(body, receive), send)


async def _read_up_to(receive: Callable[[], Awaitable[Any]], limit: int) -> bytes | None:
    """The whole request body, or None once it exceeds ``limit`` (or the client left)."""
    chunks: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """A receive callable that yields ``body`` once, then defers to the real one."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_413(send: Callable[[Any], Awaitable[None]], limit: int, path: str) -> None:
    body = json.dumps(body_for(path, 413, f"request body exceeds {limit} bytes", None,
                               "body_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await startup(app, settings)
        yield
        await shutdown(app)

    app = FastAPI(title="linserve", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None,
                  description="OpenAI-compatible server for linear-attention language models "
                              "with constant-size sessions.")
    install_error_handlers(app)
    for router in (completions.router, responses.router, messages.router, sessions.router,
                   misc.router):
        app.include_router(router)
    install_playground(app)
    origins = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
    if origins:  # closed by default: no CORS headers at all
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.state.settings = settings
    app.state.api_keys = settings.keys()
    app.state.draining = False
    return app


def wrap(app: FastAPI, settings: Settings, state_limit: int) -> ASGIApp:
    """The ASGI app to serve: the body limit sits outside everything."""
    return BodyLimit(app, settings.max_body_bytes,
                     {"/v1/sessions/import": state_limit})


async def startup(app: FastAPI, settings: Settings) -> None:
    """Start the engine (in its own process, or a thread of this one) and say so once it
    has loaded the model: the ``startup`` event's ``load_seconds`` counts from the
    command's start (``app.state.boot_time``, set by :func:`linserve.server.serve.main`),
    kernel build included."""
    t0 = getattr(app.state, "boot_time", time.monotonic())
    client: EngineBackend
    if settings.engine_mode == "process":
        process = ProcessEngineClient(settings,
                                      prelaunched=getattr(app.state, "prelaunched", None))
        await process.start_async()
        client, model = process, process.description
    else:  # the debugging mode: the model in this process (torch imported here)
        from linserve.server.engine.thread_client import start_thread_engine

        client, model = await start_thread_engine(settings)
    info = model.info
    # a vocabulary the engine read from a file is read here again, beside the first requests
    model.tokenizer().prefetch(then=trim)
    store = make_store(settings)
    bind = getattr(store, "bind_model", None)
    if bind is not None:
        bind(model.fingerprint())
    app.state.model = model
    app.state.model_name = settings.served_name
    app.state.max_model_len = info.context_limit
    app.state.dtype = model.dtype
    app.state.bf16_gemm = model.bf16_gemm
    app.state.batch_invariant = settings.batch_invariant
    spec = settings.speculative
    app.state.speculative = None if spec is None else spec.describe()
    app.state.started = int(time.time())
    app.state.client = client
    app.state.service = GenerationService(client, store, model, settings)
    app.state.service.draining = lambda: bool(app.state.draining)
    app.state.service.remote = shared_prefixes(settings, client, model.fingerprint())
    install_openapi(app, info.vocab_size, settings.max_tokens_limit)
    log.info(json.dumps(startup_event(settings, model, app.state.speculative,
                                      time.monotonic() - t0)))
    log.info("ready in %.1f s from the command's start (native kernels: %s)",
             time.monotonic() - t0, model.kernels)


def startup_event(settings: Settings, model: ModelDescription, speculative: str | None,
                  seconds: float) -> dict[str, object]:
    """The ``startup`` log event: what is served, how, and how long it took to load."""
    info = model.info
    return {
        "event": "startup", "model": settings.served_name, "weights": str(settings.weights),
        "architecture": info.architecture, "params": info.params,
        "dtype": model.dtype[0], "dtype_reason": model.dtype[1],
        "bf16_gemm": model.bf16_gemm,
        "decode_step": info.decode_step, "batch_invariant": settings.batch_invariant,
        "speculative": speculative, "quantization": info.quantization,
        "kv_cache_dtype": info.kv_cache_dtype or None, "weight_bytes": info.weight_bytes,
        "state_bytes_per_session": info.state_bytes,
        "state_note": "grows with context" if info.state_grows else "constant",
        "session_store": settings.session_store.split("@")[-1],
        "engine": settings.engine_mode,
        "threads": engine_threads(settings, info.weight_bytes),
        "kernel_build_seconds": round(model.kernel_build_seconds, 2),
        "load_seconds": round(seconds, 2)}


def shared_prefixes(settings: Settings, client: EngineBackend, fingerprint: str
                    ) -> RemotePrefixes | None:
    """Prefix states shared through Redis: with a Redis session store, the prefix cache on
    and the engine in its own process (the thread mode keeps its cache local)."""
    if (settings.session_store == "memory" or settings.prefix_cache_bytes <= 0
            or not isinstance(client, ProcessEngineClient)):
        return None
    remote = RemotePrefixes(settings.session_store, fingerprint, settings.prefix_cache_redis_ttl,
                            settings.prefix_cache_redis_max_entry_bytes)
    client.on_publish = remote.publish_soon
    return remote


async def shutdown(app: FastAPI) -> None:
    app.state.draining = True
    await app.state.client.stop()
    await app.state.service.store.close()
    if app.state.service.remote is not None:
        await app.state.service.remote.close()
    log.info(json.dumps({"event": "shutdown"}))
