"""The Responses API's stream: the chat deltas of a reply (reasoning, text, tool calls) as
its event sequence, each event numbered by ``sequence_number``::

    response.created, response.in_progress
    per output item: response.output_item.added, response.content_part.added,
        response.reasoning_text.delta / response.output_text.delta /
        response.function_call_arguments.delta, then their .done events,
        response.content_part.done and response.output_item.done
    response.completed (its status incomplete at max_output_tokens)
    on a failure: error, then response.failed

The items closed at the end are those of the finished Response (the object also returned by
GET and stored), so a client accumulating the stream ends with exactly that object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from linserve.server.api.chat_reply import ChatDeltas, reply_events
from linserve.server.api.errors import APIError
from linserve.server.api.responses.items import (
    ResponseBuilder,
    call_item,
    message_item,
    output_text,
    reasoning_item,
)
from linserve.server.engine.types import Output

_DELTA = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta",
          "function_call": "response.function_call_arguments.delta"}


@dataclass
class _Open:
    """An output item being streamed: its index, kind and text so far."""

    index: int
    item: dict[str, Any]
    text: str = ""


@dataclass
class ResponseEvents:
    """Turns one reply's outputs into Responses events."""

    builder: ResponseBuilder
    deltas: ChatDeltas
    seq: int = 0
    text: str = ""  # the reply so far, as the engine wrote it
    items: list[_Open] = field(default_factory=list)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        first = self.builder.skeleton()
        return [self.event("response.created", response=first),
                self.event("response.in_progress", response=first)]

    def feed(self, out: Output) -> list[dict[str, Any]]:
        """The events of one engine output (the closing ones after the last)."""
        self.text += out.text
        return reply_events(self.deltas, out, self._delta, self._close)

    def failed(self, err: APIError) -> list[dict[str, Any]]:
        """A failure mid-stream: an ``error`` event, then ``response.failed`` with the
        error in the Response."""
        error = {"code": err.code or "server_error", "message": err.message}
        failed = {**self.builder.skeleton("failed"), "error": error}
        return [self.event("error", **error, param=err.param),
                self.event("response.failed", response=failed)]

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        suffix = self.builder.rid.removeprefix("resp_")
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"],
                              lambda: reasoning_item(suffix, "", "in_progress"))
        if "content" in delta:
            return self._text("message", delta["content"],
                              lambda: message_item(suffix, "", "in_progress"))
        call = delta["tool_calls"][0]
        if "id" in call:
            item = call_item(call["id"], call["function"]["name"], "", "in_progress")
            return self._open(item)
        return self._text("function_call", call["function"]["arguments"], lambda: {})

    def _text(self, kind: str, text: str, new: Any) -> list[dict[str, Any]]:
        current = next((o for o in self.items if o.item["type"] == kind
                        and (kind != "function_call" or o is self.items[-1])), None)
        events = [] if current is not None else self._open(new())
        current = current or self.items[-1]
        current.text += text
        part: dict[str, Any] = {} if kind == "function_call" else {"content_index": 0}
        if kind == "message":
            part["logprobs"] = []
        events.append(self.event(_DELTA[kind], item_id=current.item["id"],
                                 output_index=current.index, delta=text, **part))
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        opened = _Open(len(self.items), item)
        self.items.append(opened)
        events = [self.event("response.output_item.added", output_index=opened.index,
                             item={**item, **_emptied(item)})]
        part = _empty_part(item)
        if part is not None:
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=opened.index, content_index=0, part=part))
        return events

    def _close(self, out: Output) -> list[dict[str, Any]]:
        """Done events for every item (as the finished Response has it), then the
        Response's own closing event."""
        final = self.builder.finished(self.text, out)
        by_id = {item["id"]: item for item in final["output"]}
        events: list[dict[str, Any]] = []
        streamed = {o.item["id"] for o in self.items}
        for item in final["output"]:
            if item["id"] not in streamed:
                events += self._open(item)
        for opened in self.items:
            item = by_id.get(opened.item["id"], opened.item)
            events += self._done(opened.index, item)
        # an incomplete one (max_output_tokens) closes with response.completed too, as vLLM
        # sends it: the SDK's stream helper waits for that event
        kind = "response.failed" if final["status"] == "failed" else "response.completed"
        events.append(self.event(kind, response=final))
        return events

    def _done(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        ref = {"item_id": item["id"], "output_index": index}
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **ref,
                                     arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self.event("response.output_text.done", **ref, content_index=0,
                                         text=part["text"], logprobs=[]))
            else:
                events.append(self.event("response.reasoning_text.done", **ref,
                                         content_index=0, text=part["text"]))
            events.append(self.event("response.content_part.done", **ref, content_index=0,
                                     part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def _empty_part(item: dict[str, Any]) -> dict[str, Any] | None:
    if item["type"] == "message":
        return output_text("")
    if item["type"] == "reasoning":
        return {"type": "reasoning_text", "text": ""}
    return None


def _emptied(item: dict[str, Any]) -> dict[str, Any]:
    """The fields of an item as ``output_item.added`` announces it (no content yet)."""
    if item["type"] == "function_call":
        return {"arguments": "", "status": "in_progress"}
    return {"content": [], "status": "in_progress"}
