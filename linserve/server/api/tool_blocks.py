"""Reading one tool-call block as it is generated, so that a call's arguments stream.

A block is the text between a format's markers (``<tool_call>`` … ``</tool_call>``), or a
whole forced reply. Its reader takes the text in pieces (:meth:`BlockReader.feed`) and gives
back, in order, a :class:`ToolCall` that opens a call (its
``arguments`` empty, or whole where a format cannot stream them) and :class:`ArgsPiece`
objects that extend the open call's arguments. A stream of these is what the APIs send:
``delta.tool_calls[].function.arguments`` pieces, ``response.function_call_arguments.delta``
and ``input_json_delta``; the whole reply is the same pieces joined.

A call is *committed* (its opening given out) once its function's name is read and is one
of the request's tools. Before that nothing leaves the block, and a block that never commits
(an unknown function, text that is not a call) stays content, verbatim. After it, the call
stands, as OpenAI's own stream does: a call cut off by ``max_tokens`` keeps what was
generated, and the reply's ``finish_reason`` says why.

- :class:`JsonCalls`: Hermes' ``{"name", "arguments"}`` object, Nemotron's array of them and
  the forced array of ``{"name", "parameters"}``. The arguments are the model's own JSON text
  of the object, streamed as written (a string holding JSON is decoded at its end).
- :class:`XmlCall`: Qwen3's ``<function=NAME><parameter=KEY>VALUE</parameter>…</function>``.
  The arguments are built as JSON as the parameters arrive: a string value streams
  character by character; any other type (from the tool's schema) comes whole when its
  parameter closes. A cut-off call is closed so that its arguments are valid JSON.
- :class:`WholeBlock`: LFM2's Python calls, read when the block ends (a Python literal
  cannot be turned into JSON piece by piece).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Schemas = dict[str, dict[str, Any]]  # function name -> its parameters' JSON schema


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + secrets.token_hex(12)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def convert(value: str, schema: dict[str, Any]) -> Any:
    """An XML parameter's text as the type its schema names (text when it does not fit)."""
    if is_text(schema):
        return value
    try:
        return json.loads(value)
    except ValueError:
        kind = schema.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if "boolean" in kinds and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value


def is_text(schema: dict[str, Any]) -> bool:
    """Whether a parameter's value is kept as text: a string type, or no type and no enum."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return "string" in kinds or (kind is None and "enum" not in schema)


@dataclass
class ArgsPiece:
    """More of the open call's arguments (JSON text)."""

    text: str


class BlockReader:
    """One block, read incrementally (see the module docstring)."""

    committed = False

    def feed(self, text: str) -> list[Any]:
        """Events for ``text`` (more of the block, never its end marker)."""
        raise NotImplementedError

    def close(self, complete: bool) -> list[Any] | None:
        """The last events: at the end marker (``complete``) or where the output ended.
        None: the block holds no call and stays content."""
        raise NotImplementedError


def _string_text(value: str) -> str:
    """``value`` as it appears inside a JSON string (escaped, no quotes)."""
    return json.dumps(value, ensure_ascii=False)[1:-1]


class JsonCalls(BlockReader):
    """Calls as JSON objects: the block itself (``depth`` 1) or the items of an array
    (``depth`` 2), each ``{"name": …, "<args_key>": {…}}``."""

    def __init__(self, schemas: Schemas, depth: int, args_keys: tuple[str, ...]) -> None:
        self.schemas, self.depth, self.args_keys = schemas, depth, args_keys
        self.stack: list[str] = []  # open containers, "{" or "["
        self.in_string = self.escape = False
        self.token = ""  # the string being read at the call's level (a key or the name)
        self.key = ""  # the call object's last key
        self.expect_value = False  # after its colon
        self.value_of: str | None = None  # the key whose string value is being read
        self.name: str | None = None
        self.args = ""  # the current call's arguments text so far
        self.args_sent = 0  # how much of it left as pieces
        self.in_args = False
        self.invalid = False

    def feed(self, text: str) -> list[Any]:
        events: list[Any] = []
        for ch in text:
            if not self.invalid:
                self._step(ch, events)
        if self.committed and self.name is not None and not self._string_args():
            self._flush(events)
        return events

    def _string_args(self) -> bool:
        return self.args.lstrip().startswith('"')

    def _flush(self, events: list[Any]) -> None:
        if len(self.args) > self.args_sent:
            events.append(ArgsPiece(self.args[self.args_sent:]))
            self.args_sent = len(self.args)

    def _step(self, ch: str, events: list[Any]) -> None:
        level = len(self.stack)
        if self.in_args:
            self.args += ch
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if level == self.depth and not self.in_args:
                    self._string_done(events)
                elif self.in_args and level == self.depth:
                    self._args_done(events)  # a string holding JSON
                return
            if level == self.depth and not self.in_args:
                self.token += ch
            return
        if ch.isspace():
            return
        if level == self.depth and self.expect_value and not self.in_args:
            self.expect_value = False
            self.value_of = self.key if ch == '"' else None
            if self.key in self.args_keys:
                self.in_args, self.args = True, ch
        if ch == '"':
            self.in_string, self.token = True, ""
        elif ch in "{[":
            self.stack.append(ch)
        elif ch in "}]":
            self._close_container(events)
        elif ch == ":" and level == self.depth:
            self.expect_value = True

    def _string_done(self, events: list[Any]) -> None:
        """A string at the call object's level ended: a key, or a value (the name's)."""
        if self.value_of is None:
            self.key = self.token
        elif self.value_of == "name":
            self._named(self.token, events)
        self.value_of = None

    def _named(self, name: str, events: list[Any]) -> None:
        if name not in self.schemas:
            self.invalid = True  # an unknown function: the block stays content
            return
        self.name, self.committed = name, True
        events.append(ToolCall(name, ""))

    def _close_container(self, events: list[Any]) -> None:
        if not self.stack:
            self.invalid = True
            return
        self.stack.pop()
        level = len(self.stack)
        if self.in_args and level == self.depth:
            self._args_done(events)
        elif level == self.depth - 1:
            self._call_done()

    def _args_done(self, events: list[Any]) -> None:
        self.in_args, self.value_of = False, None
        if self.name is None:
            self.invalid = True  # arguments before the name: not a call this reads
        elif self._string_args():
            try:
                decoded = json.loads(json.loads(self.args))
            except ValueError:
                decoded = None
            events.append(ArgsPiece(json.dumps(decoded, ensure_ascii=False)
                                    if isinstance(decoded, dict) else "{}"))
            self.args_sent = len(self.args)
        else:
            self._flush(events)

    def _call_done(self) -> None:
        if self.name is None:
            self.invalid = True
        self.name, self.args, self.args_sent, self.key, self.value_of = None, "", 0, "", None

    def close(self, complete: bool) -> list[Any] | None:
        return [] if self.committed else None


class XmlCall(BlockReader):
    """``<function=NAME>`` and ``<parameter=KEY>\\nVALUE\\n</parameter>`` as JSON."""

    def __init__(self, schemas: Schemas) -> None:
        self.schemas = schemas
        self.buf = ""  # text not yet consumed
        self.props: dict[str, Any] = {}
        self.param: str | None = None  # the open parameter
        self.value = ""  # a non-string parameter's text so far
        self.leading = True  # at a value's start (its first newline is markup)
        self.keys = 0
        self.done = False

    def feed(self, text: str) -> list[Any]:
        self.buf += text
        events: list[Any] = []
        while not self.done and self._advance(events):
            pass
        return events

    def _advance(self, events: list[Any]) -> bool:
        """Consume what can be decided; False when more text is needed."""
        if not self.committed:
            return self._read_name(events)
        if self.param is None:
            return self._read_tag(events)
        return self._read_value(events)

    def _read_name(self, events: list[Any]) -> bool:
        at, end = self.buf.find("<function="), self.buf.find(">")
        if at < 0 or end < at:
            return False
        name = self.buf[at + len("<function="):end].strip()
        if name not in self.schemas or self.buf[:at].strip():
            self.done = True  # not a call of a known function: the block stays content
            return False
        self.committed, self.buf = True, self.buf[end + 1:]
        self.props = self.schemas[name].get("properties", {})
        events.append(ToolCall(name, ""))
        return True

    def _read_tag(self, events: list[Any]) -> bool:
        param, end = self.buf.find("<parameter="), self.buf.find("</function>")
        if end >= 0 and (param < 0 or end < param):
            events.append(ArgsPiece("}" if self.keys else "{}"))
            self.done = True
            return False
        close = self.buf.find(">", param)
        if param < 0 or close < 0:
            return False
        key = self.buf[param + len("<parameter="):close].strip()
        self.buf, self.param, self.value, self.leading = self.buf[close + 1:], key, "", True
        opening = ("{" if not self.keys else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self.keys += 1
        events.append(ArgsPiece(opening + ('"' if self._is_text(key) else "")))
        return True

    def _is_text(self, key: str) -> bool:
        return is_text(self.props.get(key, {}))

    def _read_value(self, events: list[Any]) -> bool:
        assert self.param is not None
        if self.leading and self.buf:
            self.buf, self.leading = self.buf.removeprefix("\n"), False
        end = self.buf.find("</parameter>")
        if end >= 0:
            value = self.buf[:end].removesuffix("\n")
            self.buf = self.buf[end + len("</parameter>"):]
            events.append(ArgsPiece(self._value_end(value)))
            self.param = None
            return True
        keep = max(held_suffix(self.buf, "\n</parameter>"), held_suffix(self.buf, "</parameter>"))
        ready, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        if ready and self._is_text(self.param):
            events.append(ArgsPiece(_string_text(ready)))
        else:
            self.value += ready
        return False

    def _value_end(self, tail: str) -> str:
        """The JSON that ends the open parameter, whose last text is ``tail``."""
        assert self.param is not None
        if self._is_text(self.param):
            return _string_text(tail) + '"'
        return json.dumps(convert(self.value + tail, self.props.get(self.param, {})),
                          ensure_ascii=False)

    def close(self, complete: bool) -> list[Any] | None:
        if not self.committed:
            return None
        if self.done:
            return []
        events: list[Any] = []
        if self.param is not None:  # cut off inside a value: end it, and the object
            events.append(ArgsPiece(self._value_end(self.buf)))
            self.param = None
        events.append(ArgsPiece("}" if self.keys else "{}"))
        self.done = True
        return events


class WholeBlock(BlockReader):
    """A format read only when its block ends (the calls come whole)."""

    def __init__(self, parse: Callable[[str], list[Any] | None]) -> None:
        self.parse, self.text = parse, ""

    def feed(self, text: str) -> list[Any]:
        self.text += text
        return []

    def close(self, complete: bool) -> list[Any] | None:
        return self.parse(self.text) if complete else None


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
