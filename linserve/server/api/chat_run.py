"""Starting a chat request, shared by every API that speaks chat: OpenAI chat completions,
the Responses API and Anthropic's Messages API all become a :class:`ChatRequest` and start
here (the prompt rendered by the checkpoint's template or the plain one, tool calls and
reasoning read as the request asks), then each renders the replies in its own format."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from linserve.model.inputs import Insert
from linserve.server import metrics
from linserve.server.api import reasoning
from linserve.server.api.chat_reply import ChatShape
from linserve.server.api.chat_session import ChatTurn, next_prompt
from linserve.server.api.chat_template import CHAT_STOP, render_chat
from linserve.server.api.errors import APIError
from linserve.server.api.images import PromptImage, place, read_images
from linserve.server.api.next_turn import Place
from linserve.server.api.protocol import ChatRequest, CompletionRequest
from linserve.server.api.service import GenerationService, Prepared
from linserve.server.api.streaming import log_request, observe_tokens
from linserve.server.engine.client import RequestHandle
from linserve.server.engine.types import Output
from linserve.server.grammar.spec import GrammarSpec
from linserve.server.sessions.store import SessionUnavailable

DEFAULT_CHAT_TOKENS = 256
DISCONNECT_POLL_SECONDS = 0.25


@dataclass
class ChatRun:
    """A started chat request: its choices' handles, how replies are read, its prompt."""

    handles: list[RequestHandle]
    shape: ChatShape
    prompt_ids: list[int]


def chat_request(fields: dict[str, Any], param: str) -> ChatRequest:
    """The chat request another API's request becomes (a 400 on ``param`` if it is not
    one)."""
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise APIError(400, f"{param}: {first.get('msg', 'invalid')}", param,
                       "invalid_value") from None


def check_inputs(svc: GenerationService, body: ChatRequest) -> None:
    """A 400 for any content part the served model cannot take: never dropped in silence.
    An image part needs a model with an image encoder (``info.input_kinds``)."""
    served, name = set(svc.model.info.input_kinds), svc.settings.served_name
    for i, message in enumerate(body.messages):
        for kind in message.input_kinds():
            if kind == "image" and kind not in served:
                raise APIError(400, f"messages[{i}]: the model {name!r} takes no image "
                               f"input (it reads text only); send the message without its "
                               f"image parts", f"messages[{i}].content", "unsupported_input")
            if kind not in served:
                raise APIError(400, f"messages[{i}]: content parts of type {kind!r} are not "
                               f"supported (text and image parts are)",
                               f"messages[{i}].content", "unsupported_input")


async def start_chat(svc: GenerationService, body: ChatRequest, owner: str,
                     meta: Callable[[str, Output], dict[str, Any]] | None = None,
                     call_ids: str = "") -> ChatRun:
    """Render, tokenize, validate and submit ``body`` (``n`` choices). ``meta``: what a
    session keeps beside the reply's state (see :class:`Prepared`); ``call_ids``: the
    prefix of the reply's tool-call ids (default: random ids)."""
    check_inputs(svc, body)
    found = await _images(svc, body)
    text, stops, shape, turn = await _chat_prompt(svc, body, owner)
    shape.call_ids = call_ids
    prompt_ids, inserts = _placed(svc, text, found)
    n_lp = (body.top_logprobs or 0) if body.logprobs else None
    prep = prepare(svc, body, owner, prompt_ids, DEFAULT_CHAT_TOKENS, n_lp,
                   body.stop_list() + stops, await svc.grammar_of(body))
    prep.turn, prep.meta, prep.inserts = turn, meta, inserts
    # a state right after each image: a change of the text after it never redoes it
    keep = [item.end for item in inserts]
    # a stateless reply whose conversation is prefilled again after it (next_turn.py)
    turns = svc.next_turns if body.session_id is None and body.n == 1 else None
    placing = _placing(svc, found)
    if turns is not None and body.add_generation_prompt and not body.continue_final_message:
        keep.append(turns.boundary(body.messages, _render_vars(svc, body), prompt_ids,
                                   placing))
    prep.keep_at = tuple(k for k in keep if k)
    handles = await svc.start_choices(prep, body.n)
    if turns is not None:
        turns.remember(handles[0], [m.model_dump(exclude_none=True) for m in body.messages],
                       _render_vars(svc, body), lambda reply: shape.message(reply)[0],
                       placing)
    return ChatRun(handles, shape, prompt_ids)


def prepare(svc: GenerationService, body: CompletionRequest | ChatRequest, owner: str,
             prompt_ids: list[int], default_max: int, logprobs: int | None,
             stop: tuple[str, ...], grammar: GrammarSpec | None) -> Prepared:
    default_max = min(default_max, svc.settings.max_tokens_limit)
    max_tokens = svc.check_max_tokens(body.requested_max_tokens() or default_max)
    params = body.to_sampling_params(max_tokens, logprobs)
    svc.check_stop_ids(params)
    echo_lp = isinstance(body, CompletionRequest) and body.echo and logprobs is not None
    fault = None
    if svc.settings.fault_injection and body.model_extra:
        fault = body.model_extra.get("linserve_fault")
    # chat: the plain template's transcript rules (a checkpoint template's sessions keep
    # their turns through server.api.chat_session instead)
    return Prepared(prompt_ids, params, stop, owner, body.session_id, body.state,
                    prompt_logprobs=echo_lp,
                    chat=isinstance(body, ChatRequest) and svc.chat is None, fault=fault,
                    grammar=grammar)


async def collect_reply(svc: GenerationService, handle: RequestHandle, request: Request) -> Output:
    """The whole result of a non-streaming request, with its metrics and log line. A client
    that disconnects first has its request cancelled (the session is left unchanged: the
    client received nothing)."""
    task = asyncio.ensure_future(svc.collect(handle))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                break
            if await request.is_disconnected():
                metrics.DISCONNECTS.inc()
                handle.cancel()
                await asyncio.wait({task})
                break
    except asyncio.CancelledError:
        handle.cancel()
        raise
    out = task.result()
    observe_tokens(handle, out)
    log_request(handle, out, "ok" if out.finish_reason != "cancelled" else "disconnected")
    return out


# template variables a request may not override through chat_template_kwargs
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                      "bos_token", "eos_token", "continue_final_message"})


def _constrained(body: ChatRequest) -> bool:
    """Whether the output is held to a grammar (a forced call or structured output)."""
    try:
        return body.forced_tool()[0] or body.grammar_spec() is not None
    except ValueError:
        return True  # an invalid one: grammar_of answers the 400


async def count_prompt(svc: GenerationService, body: ChatRequest, owner: str) -> int:
    """The prompt tokens a chat request would have, its images' included."""
    check_inputs(svc, body)
    found = await _images(svc, body)
    return len(_placed(svc, (await _chat_prompt(svc, body, owner))[0], found)[0])


async def _images(svc: GenerationService, body: ChatRequest) -> list[PromptImage]:
    """The request's images, read and prepared (none for a model that takes none)."""
    spec = svc.info.image_spec
    return await read_images(body.messages, spec, svc.settings) if spec is not None else []


def _placing(svc: GenerationService, found: list[PromptImage]) -> Place | None:
    """How this request's images go into another rendering of its conversation (the next
    turn's, next_turn.py); None where it has none."""
    spec = svc.info.image_spec
    if spec is None or not found:
        return None
    return lambda ids: place(ids, spec.placeholder, found)


def _placed(svc: GenerationService, text: str, found: list[PromptImage]
            ) -> tuple[list[int], tuple[Insert, ...]]:
    """The prompt's ids, each image where the template put its placeholder."""
    ids = svc.tokenize_prompt(text, "messages")
    spec = svc.info.image_spec
    return (ids, ()) if spec is None else place(ids, spec.placeholder, found)


async def _chat_prompt(svc: GenerationService, body: ChatRequest, owner: str
                       ) -> tuple[str, tuple[str, ...], ChatShape, ChatTurn | None]:
    """The prompt text, the extra stop strings and the reply's shape of a chat request, and
    for a session with the checkpoint's template, its turn (server.api.chat_session)."""
    if svc.chat is None:  # a base model: tools are not shown to it, a forced call still holds
        return (render_chat(body.messages), CHAT_STOP,
                ChatShape(forced=body.forced_tool()[0]), None)
    render = _render_vars(svc, body)
    if body.session_id:
        return await _session_turn(svc, body, owner, render)
    try:
        text = svc.chat.render(body.messages, body.add_generation_prompt,
                               body.continue_final_message, **render)
    except ValueError as exc:
        raise APIError(400, str(exc), "messages", "invalid_messages") from None
    return text, (), _shape(svc, body, render, text), None


async def _session_turn(svc: GenerationService, body: ChatRequest, owner: str,
                        render: dict[str, Any]
                        ) -> tuple[str, tuple[str, ...], ChatShape, ChatTurn | None]:
    """A template chat session's turn: the new messages after the stored conversation."""
    assert svc.chat is not None and body.session_id is not None
    if body.continue_final_message or not body.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt=false are not "
                       "supported with session_id", "session_id", "unsupported_parameter")
    try:
        sess = await svc.store.get(body.session_id, owner)
    except SessionUnavailable as exc:
        raise APIError(503, "session store unavailable", "session_id") from exc
    if sess is None:
        raise APIError(404, f"session {body.session_id!r} not found", "session_id")
    prompt, conversation = next_prompt(svc.chat, sess.chat, sess.tokens, body.messages,
                                       **render)
    shape = _shape(svc, body, render, conversation.text + prompt)
    turn = ChatTurn(conversation, render, lambda text: shape.message(text)[0], sess.version)
    return prompt, (), shape, turn


def _render_vars(svc: GenerationService, body: ChatRequest) -> dict[str, Any]:
    """The template variables of a request: tools, documents, chat_template_kwargs."""
    tools = body.tool_dicts() if body.tool_choice != "none" else []
    extra = dict(body.chat_template_kwargs or {})
    if svc.settings.reasoning_parser and _constrained(body):
        # the grammar holds from the first token, so the model does not think first
        # (vLLM defers it until </think>; here thinking is switched off for such requests)
        extra.setdefault("enable_thinking", False)
    bad = RESERVED & set(extra)
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {sorted(bad)}",
                       "chat_template_kwargs", "invalid_parameter")
    return {"tools": tools or None, "documents": body.documents, **extra}


def _shape(svc: GenerationService, body: ChatRequest, render: dict[str, Any], text: str
           ) -> ChatShape:
    """How the reply to the rendered ``text`` is read: tool calls, reasoning."""
    thinking = reasoning.starts_thinking(text) if svc.settings.reasoning_parser else None
    return ChatShape(render.get("tools") or [], svc.tool_parser, body.forced_tool()[0],
                     thinking)


