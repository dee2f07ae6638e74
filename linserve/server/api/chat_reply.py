"""A chat reply's text as an OpenAI message: reasoning (``reasoning_content``), answer
(``content``) and tool calls (``tool_calls``), whole or as streamed deltas.

The order of the splits: the reasoning parser (server.api.reasoning) takes ``<think>`` text
first; what follows is the answer, in which the tool-call parser (server.api.tool_calls)
finds calls. A forced call (``tool_choice`` required or named) is a JSON array the grammar
guaranteed. Either way a call's arguments stream as they are generated: its opening delta
(id, name, empty arguments) once the name is read, then argument pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from linserve.server.api import reasoning, tool_calls
from linserve.server.api.formatting import StripStream
from linserve.server.api.tool_calls import ToolCall
from linserve.server.engine.types import Output

Event = dict[str, Any]


@dataclass
class ChatShape:
    """What a request asks of its replies."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # empty: no call parsing
    parser: str = "hermes"
    forced: bool = False
    thinking: bool | None = None  # None: no reasoning parser; else starts inside <think>
    call_ids: str = ""  # if set, the k-th call's id is call_ids + k (a stream and a whole
    # reply then name their calls alike); else each id is random

    def name_call(self, call: ToolCall, index: int) -> ToolCall:
        if self.call_ids:
            call.id = f"{self.call_ids}{index}"
        return call

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message, whether it holds tool calls) of a whole reply."""
        think, content = (reasoning.split(text, self.thinking) if self.thinking is not None
                          else (None, text))
        calls: list[ToolCall] = []
        if self.forced:
            content, calls = tool_calls.extract_forced(content, self.tools)
        elif self.tools:
            content, calls = tool_calls.extract(self.parser, content, self.tools)
        msg: dict[str, Any] = {"role": "assistant",
                               "content": content.strip() or (None if calls else "")}
        if think is not None:
            msg["reasoning_content"] = think
        if calls:
            msg["tool_calls"] = [self.name_call(c, k).to_openai() for k, c in enumerate(calls)]
        return msg, bool(calls)


class ChatDeltas:
    """One choice's stream: :meth:`feed` new text, get the ``delta`` objects to send."""

    def __init__(self, shape: ChatShape) -> None:
        self.shape = shape
        self.think = (reasoning.ReasoningStream(shape.thinking)
                      if shape.thinking is not None else None)
        self.tools = (tool_calls.ToolStream(shape.parser, shape.tools)
                      if shape.tools and not shape.forced else None)
        self.forced = tool_calls.forced_reader(shape.tools) if shape.forced else None
        self.forced_text = ""
        self.strip = StripStream()
        self.calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        parts = self.think.feed(text) if self.think else [("content", text)]
        return self._deltas(parts)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas held back until the end (and a forced call, parsed now)."""
        parts = self.think.finish() if self.think else []
        out = self._deltas(parts)
        if self.tools is not None:
            out += self._answer(self.tools.finish())
        if self.forced is not None:
            closing = self.forced.close(True)
            out += self._answer(closing if closing is not None else [self.forced_text])
        return out

    def _deltas(self, parts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self.forced is not None:
                self.forced_text += text
                out += self._answer(self.forced.feed(text))
            elif self.tools is not None:
                out += self._answer(self.tools.feed(text))
            else:
                out += self._answer([text])
        return out

    def _answer(self, events: list[tool_calls.Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, str):
                text = self.strip.feed(event)
                if text:
                    out.append({"content": text})
                continue
            if isinstance(event, ToolCall):
                index, self.calls = self.calls, self.calls + 1
                event = self.shape.name_call(event, index)
                out.append({"tool_calls": [{"index": index, "id": event.id, "type": "function",
                                            "function": {"name": event.name,
                                                         "arguments": ""}}]})
                pieces = event.arguments
            else:
                pieces = event.text
            if pieces and self.calls:  # more of the open call's arguments
                out.append({"tool_calls": [{"index": self.calls - 1,
                                            "function": {"arguments": pieces}}]})
        return out


def reply_events(deltas: ChatDeltas, out: Output, on_delta: Callable[[dict[str, Any]],
                 list[Event]], on_close: Callable[[Output], list[Event]]) -> list[Event]:
    """The events another API streams for one output of a reply: each chat delta's through
    ``on_delta``, and once the reply is done (not cancelled) the closing ones."""
    parts = deltas.feed(out.text)
    if out.finish_reason is not None:
        parts += deltas.finish()
    events = [event for part in parts for event in on_delta(part)]
    if out.finish_reason is not None and out.finish_reason != "cancelled":
        events += on_close(out)
    return events
