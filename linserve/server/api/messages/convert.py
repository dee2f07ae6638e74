"""Between Anthropic messages and chat: a Messages request as a chat request (so it runs
through the chat path, with the checkpoint's template), and a reply as content blocks."""

from __future__ import annotations

import json
import secrets
from typing import Any

from linserve.server.api.chat_run import chat_request
from linserve.server.api.messages.protocol import (
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    arguments,
)
from linserve.server.api.protocol import ChatMessage, ChatRequest
from linserve.server.engine.types import Output


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def to_messages(body: MessagesRequest) -> list[ChatMessage]:
    """Chat messages: the system text first; a user message's tool results become tool
    messages (before its text); an assistant message's tool uses its tool calls and its
    thinking its reasoning."""
    out: list[dict[str, Any]] = []
    system = body.system_text()
    if system:
        out.append({"role": "system", "content": system})
    for message in body.messages:
        blocks = message.blocks()
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if message.role == "user":
            out += [{"role": "tool", "content": _with_images(b.text(), b.images()),
                     "tool_call_id": b.tool_use_id}
                    for b in blocks if isinstance(b, ToolResultBlock)]
            images = [b for b in blocks if isinstance(b, ImageBlock)]
            if text or images or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": _user_content(blocks)})
            continue
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if thought:
            reply["reasoning_content"] = thought
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": arguments(b)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            reply["tool_calls"] = calls
        out.append(reply)
    return [ChatMessage.model_validate(m) for m in out]


def _user_content(blocks: list[Any]) -> str | list[dict[str, Any]]:
    """A user message's text, or its text and image blocks in order as chat parts."""
    if not any(isinstance(b, ImageBlock) for b in blocks):
        return "".join(b.text for b in blocks if isinstance(b, TextBlock))
    return [b.as_chat() if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
            for b in blocks if isinstance(b, TextBlock | ImageBlock)]


def _with_images(text: str, images: list[ImageBlock]) -> str | list[dict[str, Any]]:
    """A tool result's content: its text, and its images as chat parts after it."""
    if not images:
        return text
    return [{"type": "text", "text": text}, *(b.as_chat() for b in images)]


def to_chat(body: MessagesRequest) -> ChatRequest:
    """The chat request that runs ``body``."""
    fields: dict[str, Any] = {
        "messages": to_messages(body), "max_tokens": body.max_tokens,
        "temperature": body.temperature, "top_p": body.top_p or 1.0,
        "top_k": body.top_k or 0, "seed": body.seed, "stop": body.stop_sequences,
        "stream": body.stream}
    if body.tools:
        fields["tools"] = [t.as_openai() for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, {"type": "function", "function": {"name": choice.name}})
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    fault = (body.model_extra or {}).get("linserve_fault")
    if fault is not None:  # a test-only engine fault (settings.fault_injection), passed on
        fields["linserve_fault"] = fault
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.schema_}}
    thinking = body.thinking
    fields["chat_template_kwargs"] = {
        "enable_thinking": thinking is not None and thinking.type != "disabled"}
    return chat_request(fields, "messages")


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A reply (a chat message: reasoning, content, tool calls) as content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append(tool_use(call["id"], call["function"]["name"],
                               call["function"]["arguments"]))
    return blocks


def tool_use(call_id: str, name: str, args: str) -> dict[str, Any]:
    try:
        data = json.loads(args) if args.strip() else {}
    except ValueError:
        data = {}
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": data if isinstance(data, dict) else {"value": data}}


def stop_of(out: Output, body: MessagesRequest, called: bool) -> tuple[str | None, str | None]:
    """``stop_reason`` and ``stop_sequence`` of a finished reply."""
    if out.finish_reason in ("cancelled", "error"):
        return None, None
    if out.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if out.stop_string is not None and out.stop_string in (body.stop_sequences or ()):
        return "stop_sequence", out.stop_string
    return "end_turn", None


def usage(prompt_tokens: int, out: Output) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` excludes what the prefix cache served."""
    cached = min(out.cached_tokens, prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "output_tokens": out.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
