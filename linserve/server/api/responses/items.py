"""Between Responses items and chat: the input items as chat messages (so the request runs
through the chat path, with the checkpoint's template), and a reply as output items inside
the Response object."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from linserve.model.tokenizer import TextTokenizer
from linserve.server.api.chat_reply import ChatShape
from linserve.server.api.chat_run import chat_request
from linserve.server.api.protocol import ChatMessage, ChatRequest
from linserve.server.api.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    NamedFunction,
    ReasoningItem,
    ResponsesRequest,
)
from linserve.server.engine.types import Output

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def to_messages(items: list[Item]) -> list[ChatMessage]:
    """Chat messages of input items: a function_call joins the assistant message before it
    (one assistant turn: text, then its calls), a function_call_output is a tool message, a
    reasoning item goes with the assistant message that follows it."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
        elif isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.chat_content()})
            if item.role == "assistant":
                out[-1]["reasoning_content"], reasoning = reasoning, None
        elif isinstance(item, FunctionCallItem):
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": "",
                            "reasoning_content": reasoning})
                reasoning = None
            out[-1].setdefault("tool_calls", []).append({
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}})
        else:
            out.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
    return [ChatMessage.model_validate(m) for m in out]


def to_chat(body: ResponsesRequest, messages: list[ChatMessage], session_id: str | None
            ) -> ChatRequest:
    """The chat request that runs ``body`` (``messages``: its input, with the instructions
    as a system message where they apply)."""
    fields: dict[str, Any] = {
        "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
        "parallel_tool_calls": body.parallel_tool_calls, "session_id": session_id,
        "stream": body.stream}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(
            exclude_none=True, exclude={"type"})} for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        spec = fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        fields["response_format"] = {"type": fmt.type, "json_schema": spec or None}
    fault = (body.model_extra or {}).get("linserve_fault")
    if fault is not None:  # a test-only engine fault (settings.fault_injection), passed on
        fields["linserve_fault"] = fault
    thinking = body.reasoning.thinking() if body.reasoning else None
    if thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking}
    return chat_request(fields, "input")


def output_items(rid: str, message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A reply (a chat message: reasoning, content, tool calls) as output items."""
    items: list[dict[str, Any]] = []
    suffix = rid.removeprefix("resp_")
    if message.get("reasoning_content"):
        items.append(reasoning_item(suffix, message["reasoning_content"], status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(suffix, message.get("content") or "", status))
    for call in calls:
        items.append(call_item(call["id"], call["function"]["name"],
                               call["function"]["arguments"], "completed"))
    return items


def reasoning_item(suffix: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{suffix}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(suffix: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{suffix}", "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}",
            "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def status_of(out: Output) -> tuple[str, dict[str, Any] | None]:
    """A finished reply's ``status`` and ``incomplete_details``."""
    if out.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if out.finish_reason == "cancelled":
        return "cancelled", None
    if out.finish_reason == "error":
        return "failed", None
    return "completed", None


@dataclass
class ResponseBuilder:
    """Makes the Response object of one request, from its reply text and last output (the
    same object is returned, streamed in ``response.completed`` and stored)."""

    rid: str
    body: ResponsesRequest
    model: str
    tok: TextTokenizer
    shape: ChatShape = field(default_factory=ChatShape)  # set once the chat request starts
    prior_tokens: int = 0  # tokens of the stored conversation this one continues
    reused_tokens: int = 0  # of which the stored state covers (served without a prefill)
    prompt_tokens: int = 0
    created: float = field(default_factory=time.time)
    _done: dict[str, Any] | None = None  # the finished object, made once

    def skeleton(self, status: str = "in_progress") -> dict[str, Any]:
        """The object without output or usage (``response.created`` and the stored one
        while the reply runs)."""
        body = self.body
        fmt = body.text.format if body.text and body.text.format else None
        return {
            "id": self.rid, "object": "response", "created_at": int(self.created),
            "status": status, "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": [], "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": (body.reasoning.model_dump(include={"effort", "summary"})
                          if body.reasoning else {"effort": None, "summary": None}),
            "store": body.store, "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt else {"type": "text"}},
            "tool_choice": (body.tool_choice.model_dump() if isinstance(
                body.tool_choice, NamedFunction) else body.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": body.top_p, "truncation": "disabled", "usage": None, "user": body.user,
            "metadata": body.metadata or {}, "background": False, "service_tier": "default"}

    def message(self, text: str) -> dict[str, Any]:
        return self.shape.message(text)[0]

    def finished(self, text: str, out: Output) -> dict[str, Any]:
        """The whole Response once the reply (``text``, ending with ``out``) is done: made
        once, so what is stored, returned and streamed is the same object."""
        if self._done is None:
            self._done = self._finish(text, out)
        return self._done

    def _finish(self, text: str, out: Output) -> dict[str, Any]:
        status, details = status_of(out)
        message = self.message(text)
        output = output_items(self.rid, message, status)
        thought = message.get("reasoning_content") or ""
        reasoning_tokens = min(len(self.tok.encode(thought)), out.completion_tokens)
        total_in = self.prior_tokens + self.prompt_tokens
        usage = {"input_tokens": total_in,
                 "input_tokens_details": {"cached_tokens": self.reused_tokens
                                          + out.cached_tokens},
                 "output_tokens": out.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                 "total_tokens": total_in + out.completion_tokens}
        return {**self.skeleton(status), "incomplete_details": details, "output": output,
                "usage": usage, "completed_at": int(time.time())}
