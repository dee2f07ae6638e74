"""The Messages API's stream: the chat deltas of a reply as Anthropic's events::

    message_start
    per content block: content_block_start, content_block_delta (thinking_delta,
        text_delta or input_json_delta) …, content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

with ``ping`` events while the model is quiet (the stream's keep-alive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linserve.server.api.chat_reply import ChatDeltas, reply_events
from linserve.server.api.messages.convert import stop_of, usage
from linserve.server.api.messages.protocol import MessagesRequest
from linserve.server.engine.types import Output

_DELTA = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "tool_use": ("input_json_delta", "partial_json")}


@dataclass
class MessageEvents:
    """Turns one reply's outputs into Messages events."""

    message_id: str
    model: str
    body: MessagesRequest
    deltas: ChatDeltas
    prompt_tokens: int
    index: int = -1  # the open block (-1: none yet)
    kind: str = ""  # its type
    calls: int = 0

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                      "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}},
            {"type": "ping"}]

    def feed(self, out: Output) -> list[dict[str, Any]]:
        return reply_events(self.deltas, out, self._delta, self._close)

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        if "reasoning_content" in delta:
            return self._text("thinking", delta["reasoning_content"],
                              {"type": "thinking", "thinking": "", "signature": ""})
        if "content" in delta:
            return self._text("text", delta["content"], {"type": "text", "text": ""})
        call = delta["tool_calls"][0]
        if "id" in call:
            self.calls += 1
            return self._start({"type": "tool_use", "id": call["id"],
                                "name": call["function"]["name"], "input": {}})
        return self._text("tool_use", call["function"]["arguments"], {})

    def _text(self, kind: str, text: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = [] if self.kind == kind else self._start(block)
        name, field = _DELTA[kind]
        events.append({"type": "content_block_delta", "index": self.index,
                       "delta": {"type": name, field: text}})
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self.index, self.kind = self.index + 1, block["type"]
        events.append({"type": "content_block_start", "index": self.index,
                       "content_block": block})
        return events

    def _stop(self) -> list[dict[str, Any]]:
        if not self.kind:
            return []
        events: list[dict[str, Any]] = []
        if self.kind == "thinking":
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        self.kind = ""
        return [*events, {"type": "content_block_stop", "index": self.index}]

    def _close(self, out: Output) -> list[dict[str, Any]]:
        reason, sequence = stop_of(out, self.body, self.calls > 0)
        return [*self._stop(),
                {"type": "message_delta",
                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage(self.prompt_tokens, out)},
                {"type": "message_stop"}]
