"""Tool calls in model output: parsers chosen by vLLM's names, whole texts and streams.

Each format wraps calls between two markers:

- ``qwen3_xml`` (Qwen3.5, Qwen3-Coder; vLLM's ``qwen3_coder`` / ``qwen3_xml``)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

  Parameter values are text; each is converted to the type its tool's JSON schema gives it
  (integer, number, boolean, object, array; strings stay as they are).
- ``hermes`` (Hermes, Qwen2.5, Granite-4.0):
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.
- ``lfm2`` (alias ``pythonic``; LFM2 / LFM2.5): a Python list of calls with keyword
  arguments, ``<|tool_call_start|>[get_weather(city="Paris"), ...]<|tool_call_end|>``, read
  with :mod:`ast` (literals only: nothing is evaluated).
- ``nemotron`` (Nemotron-H / Nemotron-Nano-v2): a JSON array of calls,
  ``<TOOLCALL>[{"name": …, "arguments": {…}}, ...]</TOOLCALL>``.

Text outside the markers stays ``content``. A block that does not parse (malformed, an unknown
function, an unterminated call at the end of the output) stays ``content`` too, verbatim:
nothing the model wrote is dropped.

``tool_choice`` ``required`` or a named function is enforced the way vLLM does it: the output
is constrained (llguidance, :func:`forced_schema`) to a JSON array of calls of the allowed
tools with schema-valid arguments, and :func:`parse_forced` reads it back.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


def default_parser(template: str | None) -> str:
    """The parser a chat template implies: Qwen3.5's XML calls, LFM2's Python calls,
    Nemotron's JSON array, else Hermes JSON (Granite-4.0's too)."""
    if not template:
        return "hermes"
    if "<function=" in template:
        return "qwen3_xml"
    if "<TOOLCALL>" in template:
        return "nemotron"
    if "List of tools:" in template or "<|tool_call_start|>" in template:
        return "lfm2"
    return "hermes"


def _schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema."""
    out = {}
    for tool in tools:
        fn = tool.get("function", {})
        out[str(fn.get("name"))] = fn.get("parameters") or {}
    return out


def _convert(value: str, schema: dict[str, Any]) -> Any:
    """An XML parameter's text as the type its schema names (text when it does not fit)."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or (kind is None and "enum" not in schema):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        if "boolean" in kinds and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value
    return parsed


XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.S)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _parse_xml(block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    match = XML_FUNCTION.match(block)
    if match is None or match.group(1).strip() not in schemas:
        return None
    name, body = match.group(1).strip(), match.group(2)
    props = schemas[name].get("properties", {})
    args = {p.strip(): _convert(v, props.get(p.strip(), {}))
            for p, v in XML_PARAMETER.findall(body)}
    if XML_PARAMETER.sub("", body).strip():
        return None  # text between parameters: not a well-formed call
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_call(obj: Any, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    """``{"name", "arguments"}`` (or ``parameters``; arguments an object or JSON text) as a
    call of a known function."""
    if not isinstance(obj, dict) or obj.get("name") not in schemas:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(str(obj["name"]), json.dumps(args, ensure_ascii=False))


def _parse_hermes(block: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    try:
        call = _json_call(json.loads(block), schemas)
    except ValueError:
        return None
    return None if call is None else [call]


def _parse_json_array(block: str, schemas: dict[str, dict[str, Any]]
                      ) -> list[ToolCall] | None:
    try:
        items = json.loads(block)
    except ValueError:
        return None
    calls = [_json_call(item, schemas) for item in items] if isinstance(items, list) else []
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def _python_call(node: ast.expr, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    """``name(key=literal, ...)`` as a call of a known function."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
            and node.func.id in schemas):
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if None in args:  # **kwargs
        return None
    return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))


def _parse_python(block: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    try:
        tree = ast.parse(block.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    body = tree.body
    nodes = body.elts if isinstance(body, ast.List) else [body]
    calls = [_python_call(n, schemas) for n in nodes]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def _parse_xml_block(block: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    call = _parse_xml(block, schemas)
    return None if call is None else [call]


@dataclass(frozen=True)
class Format:
    """A tool-call format: the markers around a block and how a block reads (None: not a
    valid block, kept as content)."""

    start: str
    end: str
    parse: Callable[[str, dict[str, dict[str, Any]]], list[ToolCall] | None]


FORMATS: dict[str, Format] = {
    "qwen3_xml": Format("<tool_call>", "</tool_call>", _parse_xml_block),
    "hermes": Format("<tool_call>", "</tool_call>", _parse_hermes),
    "lfm2": Format("<|tool_call_start|>", "<|tool_call_end|>", _parse_python),
    "nemotron": Format("<TOOLCALL>", "</TOOLCALL>", _parse_json_array),
}
ALIASES = {"qwen3_coder": "qwen3_xml", "pythonic": "lfm2"}
PARSERS = (*FORMATS, *ALIASES)


def format_of(parser: str) -> Format:
    return FORMATS[ALIASES.get(parser, parser)]


def parse_block(parser: str, block: str, tools: list[dict[str, Any]]) -> list[ToolCall] | None:
    """The calls in the text between the markers, or None when it is not a valid block."""
    return format_of(parser).parse(block, _schemas(tools))


def extract(parser: str, text: str, tools: list[dict[str, Any]]
            ) -> tuple[str, list[ToolCall]]:
    """The content (text outside valid calls) and the calls of a whole output."""
    stream = ToolStream(parser, tools)
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ToolCall)]


class ToolStream:
    """Incremental :func:`extract`: :meth:`feed` output text as it comes, get back content
    strings and :class:`ToolCall` objects in order. Text that may be the start of a marker is
    held back until it is decided."""

    def __init__(self, parser: str, tools: list[dict[str, Any]]) -> None:
        self.parser, self.tools = parser, tools
        self.fmt = format_of(parser)
        self.pending = ""  # undecided text outside a call
        self.block: str | None = None  # inside a call: its text so far
        self.after_call = False

    def feed(self, text: str) -> list[str | ToolCall]:
        events: list[str | ToolCall] = []
        self.pending += text
        start, end = self.fmt.start, self.fmt.end
        while self.pending:
            if self.after_call:  # the newlines that follow a call belong to it
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.after_call = False
            if self.block is None:
                at = self.pending.find(start)
                if at < 0:
                    keep = _partial_suffix(self.pending, start)
                    if len(self.pending) > keep:
                        events.append(self.pending[: len(self.pending) - keep])
                        self.pending = self.pending[len(self.pending) - keep:]
                    break
                if at:
                    events.append(self.pending[:at])
                self.block, self.pending = "", self.pending[at + len(start):]
            else:
                buf = self.block + self.pending
                at = buf.find(end)
                if at < 0:
                    self.block, self.pending = buf, ""
                    break
                calls = parse_block(self.parser, buf[:at], self.tools)
                events.extend(calls if calls is not None else [start + buf[: at + len(end)]])
                self.block, self.pending = None, buf[at + len(end):]
                self.after_call = calls is not None
        return events

    def finish(self) -> list[str | ToolCall]:
        """What is left at the end: held-back text, or an unterminated call, as content."""
        rest = (self.fmt.start + self.block if self.block is not None else "") + self.pending
        self.block, self.pending = None, ""
        return [rest] if rest else []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def forced_schema(tools: list[dict[str, Any]], choice: str | None, parallel: bool
                  ) -> dict[str, Any]:
    """The JSON schema ``tool_choice`` ``required`` (``choice`` None) or a named function
    imposes: an array of one (or, with parallel calls, more) ``{"name", "parameters"}``
    objects, each a call of an allowed tool with arguments valid against its schema."""
    allowed = [t["function"] for t in tools
               if choice is None or t["function"].get("name") == choice]
    items = [{"type": "object", "properties": {
        "name": {"const": fn["name"]},
        "parameters": fn.get("parameters") or {"type": "object"}},
        "required": ["name", "parameters"], "additionalProperties": False} for fn in allowed]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_forced(text: str) -> list[ToolCall] | None:
    """The calls of an output constrained by :func:`forced_schema`; None when it was cut
    off before the array closed (``max_tokens``): the text then stays content."""
    try:
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                for c in json.loads(text)]
    except (ValueError, KeyError, TypeError):
        return None
