"""Models, tokenizer endpoints, health and metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.auth import Owner
from server.errors import APIError
from server.protocol import DetokenizeRequest, TokenizeRequest, now
from server.routes.docs import ERRORS

router = APIRouter()


@router.get("/v1/models", tags=["models"], responses=ERRORS)
async def list_models(request: Request, _: Owner) -> dict[str, Any]:
    st = request.app.state
    return {"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": st.started, "owned_by": "linserve",
        "attention": st.model.cfg.attention, "max_model_len": st.max_model_len,
        "state_bytes": st.model.state_nbytes()}]}


@router.post("/tokenize", tags=["tokenizer"], responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request, _: Owner) -> dict[str, Any]:
    ids = request.app.state.service.tok.encode(body.prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": request.app.state.max_model_len}


@router.post("/detokenize", tags=["tokenizer"], responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request, _: Owner) -> dict[str, Any]:
    tok = request.app.state.service.tok
    bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
    return {"prompt": tok.decode(body.tokens)}


@router.get("/health", tags=["health"])
async def health(request: Request) -> Response:
    """Liveness: answers at once, even under full load. 503 while draining on shutdown."""
    st = request.app.state
    store_ok = await st.service.store.healthy()
    body = {"status": "ok" if store_ok else "degraded", "model": st.model_name,
            "session_store": "ok" if store_ok else "unavailable", "time": now(),
            "draining": st.draining,
            "decode_step": "fused" if st.model.uses_fused_step else "eager"}
    import json

    code = 503 if st.draining else 200
    return Response(json.dumps(body), status_code=code, media_type="application/json")


@router.get("/metrics", tags=["health"])
async def metrics_endpoint() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
