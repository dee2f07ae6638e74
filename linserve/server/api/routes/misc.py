"""Models, tokenizer endpoints, health and metrics."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from linserve.server.api.auth import Owner
from linserve.server.api.chat_template import render_chat
from linserve.server.api.errors import APIError
from linserve.server.api.protocol import DetokenizeRequest, TokenizeRequest, now
from linserve.server.api.routes.docs import ERRORS
from linserve.server.system.memory import prefix_cache_report
from linserve.server.system.memory import report as memory_report

router = APIRouter()


@router.get("/v1/models", tags=["models"], responses=ERRORS)
async def list_models(request: Request, _: Owner) -> dict[str, Any]:
    st = request.app.state
    return {"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": st.started, "owned_by": "linserve",
        "architecture": st.model.info.architecture, "max_model_len": st.max_model_len,
        "state_bytes": st.model.info.state_bytes,
        "state_grows": st.model.info.state_grows,
        "state_bytes_per_token": st.model.info.state_bytes_per_token,
        "quantization": st.model.info.quantization,
        "kv_cache_dtype": st.model.info.kv_cache_dtype or None,
        "weight_bytes": st.model.info.weight_bytes,
        "input_modalities": ["text", *st.model.info.input_kinds]}]}


@router.post("/tokenize", tags=["tokenizer"], responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request, _: Owner) -> dict[str, Any]:
    """Token ids of ``prompt``, or of ``messages`` rendered by the chat template (then the
    rendered text is returned as ``prompt`` too, so a client sees what the model gets)."""
    svc = request.app.state.service
    text = body.prompt
    if body.messages is not None:
        if svc.chat is None:
            text = render_chat(body.messages)
        else:
            try:
                text = svc.chat.render(
                    body.messages, body.add_generation_prompt,
                    tools=[t.model_dump(exclude_none=True) for t in body.tools or []] or None,
                    **(body.chat_template_kwargs or {}))
            except (ValueError, TypeError) as exc:
                raise APIError(400, str(exc), "messages", "invalid_messages") from None
    ids = svc.tok.encode(text or "")
    out = {"tokens": ids, "count": len(ids), "max_model_len": request.app.state.max_model_len}
    return {**out, "prompt": text} if body.messages is not None else out


@router.post("/detokenize", tags=["tokenizer"], responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request, _: Owner) -> dict[str, Any]:
    tok = request.app.state.service.tok
    bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
    return {"prompt": tok.decode(body.tokens)}


def _engine(request: Request) -> dict[str, Any]:
    health = request.app.state.client.health
    return {"status": health.status, "reason": health.reason, "since": int(health.since),
            "pid": health.pid}


def _json(body: dict[str, Any], code: int) -> Response:
    return Response(json.dumps(body), status_code=code, media_type="application/json")


@router.get("/health", tags=["health"])
async def health(request: Request) -> Response:
    """Readiness with details: 200 while the server takes requests; 503 with the reason
    while it drains on shutdown or its engine is down (restarting) or has failed."""
    st = request.app.state
    store_ok = await st.service.store.healthy()
    engine = _engine(request)
    ready = engine["status"] == "up" and not st.draining
    reason = "draining" if st.draining else engine["reason"]
    body = {"status": ("ok" if store_ok else "degraded") if ready else "unavailable",
            "reason": None if ready else reason, "model": st.model_name,
            "architecture": st.model.info.architecture, "engine": engine,
            "session_store": "ok" if store_ok else "unavailable",
            "time": now(), "draining": st.draining,
            "decode_step": st.model.info.decode_step,
            "dtype": st.dtype[0], "dtype_reason": st.dtype[1],
            "bf16_gemm": st.bf16_gemm,
            "quantization": st.model.info.quantization,
            "weight_bytes": st.model.info.weight_bytes,
            "batch_invariant": st.batch_invariant,
            "speculative": st.speculative,
            "memory": memory_report(st.client.health.pid),
            "prefix_cache": prefix_cache_report()}
    return _json(body, 200 if ready else 503)


@router.get("/health/live", tags=["health"])
async def liveness(request: Request) -> Response:
    """Liveness (restart the server if this fails): 200 while the HTTP process answers and
    its supervisor can keep an engine running, draining included; 503 once the supervisor
    has given up restarting the engine."""
    engine = _engine(request)
    failed = engine["status"] == "failed"
    return _json({"status": "failed" if failed else "ok", "engine": engine},
                 503 if failed else 200)


@router.get("/health/ready", tags=["health"])
async def readiness(request: Request) -> Response:
    """Readiness (send traffic here?): 200 only while the engine is up and the server is not
    draining."""
    st = request.app.state
    engine = _engine(request)
    ready = engine["status"] == "up" and not st.draining
    reason = "draining" if st.draining else engine["reason"]
    return _json({"status": "ready" if ready else "unavailable", "reason": None if ready
                  else reason, "engine": engine}, 200 if ready else 503)


@router.get("/metrics", tags=["health"])
async def metrics_endpoint(request: Request) -> Response:
    memory_report(request.app.state.client.health.pid)  # the sessions and runtime gauges
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
