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
- ``kimi_k2`` (Kimi-K2, Kimi-Linear): ``<|tool_calls_section_begin|>`` then, per call,
  ``<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{…}<|tool_call_end|>``,
  then ``<|tool_calls_section_end|>``.
- ``glm45`` (the Ling 3.0 hybrids, GLM-4.5): ``<tool_call>get_weather`` then
  ``<arg_key>city</arg_key><arg_value>Paris</arg_value>`` pairs, ``</tool_call>``; values
  typed by the tool's schema as ``qwen3_xml``'s are.
- ``minimax`` (MiniMax-M1 / Text-01): ``<tool_calls>`` then one JSON object a line,
  ``{"name": …, "arguments": {…}}``, then ``</tool_calls>``.

Text outside the markers stays ``content``. A block is read as it is generated
(:mod:`linserve.server.api.tool_blocks`), so a call's arguments stream: once its function's
name is read and is one of the request's tools, the call is given out and its arguments
follow in pieces. A block that never names a known function (malformed, an unknown one)
stays ``content``, verbatim: nothing the model wrote is dropped.

``tool_choice`` ``required`` or a named function is enforced the way vLLM does it: the output
is constrained (llguidance, :func:`forced_schema`) to a JSON array of calls of the allowed
tools with schema-valid arguments, read back by the same JSON reader (:func:`forced_reader`).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from linserve.server.api.tool_blocks import (
    ArgsPiece,
    BlockReader,
    JsonCalls,
    Schemas,
    ToolCall,
    WholeBlock,
    XmlCall,
    convert,
    held_suffix,
)


def default_parser(template: str | None) -> str:
    """The parser a chat template implies: Qwen3.5's XML calls, LFM2's Python calls,
    Nemotron's JSON array, Kimi's sections, Ling's key/value pairs, MiniMax's JSON lines,
    else Hermes JSON (Granite-4.0's too)."""
    if not template:
        return "hermes"
    if "<|tool_calls_section_begin|>" in template:
        return "kimi_k2"
    if "<arg_key>" in template:
        return "glm45"
    if "<tool_calls>" in template:
        return "minimax"
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


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.\-]+?)(?::\d+)?\s*"
                        r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
_ARG_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _known(name: str, arguments: Any, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    """A call of a known function with an object of arguments (None: not one)."""
    if name not in schemas or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _parse_kimi(block: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    """Kimi's calls: ``functions.NAME:INDEX`` and a JSON object each."""
    calls = []
    for name, args in _KIMI_CALL.findall(block):
        try:
            call = _known(name, json.loads(args), schemas)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _parse_arg_pairs(block: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    """One GLM-4.5-style call: its name, then ``<arg_key>``/``<arg_value>`` pairs, each value
    typed by the function's schema."""
    name = block.split("<arg_key>", 1)[0].strip()
    props = (schemas.get(name) or {}).get("properties") or {}
    args = {key.strip(): convert(value.strip(), props.get(key.strip()) or {})
            for key, value in _ARG_PAIR.findall(block)}
    call = _known(name, args, schemas)
    return None if call is None else [call]


def _parse_json_lines(block: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    """MiniMax's calls: one ``{"name": …, "arguments": {…}}`` object a line."""
    calls = []
    for line in block.strip().splitlines():
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            return None
        call = _known(str(item.get("name")), item.get("arguments"), schemas) \
            if isinstance(item, dict) else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


@dataclass(frozen=True)
class Format:
    """A tool-call format: the markers around a block and its reader."""

    start: str
    end: str
    reader: Callable[[Schemas], BlockReader]


FORMATS: dict[str, Format] = {
    "qwen3_xml": Format("<tool_call>", "</tool_call>", XmlCall),
    "hermes": Format("<tool_call>", "</tool_call>",
                     lambda s: JsonCalls(s, 1, ("arguments", "parameters"))),
    "lfm2": Format("<|tool_call_start|>", "<|tool_call_end|>",
                   lambda s: WholeBlock(lambda text: _parse_python(text, s))),
    "nemotron": Format("<TOOLCALL>", "</TOOLCALL>",
                       lambda s: JsonCalls(s, 2, ("arguments", "parameters"))),
    "kimi_k2": Format("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                      lambda s: WholeBlock(lambda text: _parse_kimi(text, s))),
    "glm45": Format("<tool_call>", "</tool_call>",
                    lambda s: WholeBlock(lambda text: _parse_arg_pairs(text, s))),
    "minimax": Format("<tool_calls>", "</tool_calls>",
                      lambda s: WholeBlock(lambda text: _parse_json_lines(text, s))),
}
ALIASES = {"qwen3_coder": "qwen3_xml", "pythonic": "lfm2", "glm4_moe": "glm45"}
PARSERS = (*FORMATS, *ALIASES)
Event = str | ToolCall | ArgsPiece  # content, a call's opening, more of its arguments


def format_of(parser: str) -> Format:
    return FORMATS[ALIASES.get(parser, parser)]


def assemble(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """The content and the calls (arguments joined) of a whole reply's events."""
    content, calls = "", []
    for event in events:
        if isinstance(event, str):
            content += event
        elif isinstance(event, ToolCall):
            calls.append(ToolCall(event.name, event.arguments))
        elif calls:
            calls[-1].arguments += event.text
    return content, calls


def extract(parser: str, text: str, tools: list[dict[str, Any]]
            ) -> tuple[str, list[ToolCall]]:
    """The content (text outside calls) and the calls of a whole output."""
    stream = ToolStream(parser, tools)
    return assemble(stream.feed(text) + stream.finish())


class ToolStream:
    """Incremental :func:`extract`: :meth:`feed` output text as it comes, get back content
    strings, call openings and argument pieces in order. Text that may be the start of a
    marker is held back until it is decided."""

    def __init__(self, parser: str, tools: list[dict[str, Any]]) -> None:
        self.fmt, self.schemas = format_of(parser), _schemas(tools)
        self.pending = ""  # undecided text
        self.reader: BlockReader | None = None  # inside a block: its reader
        self.raw = ""  # the block's text so far (content again if it holds no call)
        self.after_call = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self.pending += text
        while self.pending:
            if self.after_call:  # the newlines that follow a call belong to it
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.after_call = False
            done = self._outside(events) if self.reader is None else self._inside(events)
            if done:
                break
        return events

    def _outside(self, events: list[Event]) -> bool:
        """Content up to a block's start marker; True when more text is needed."""
        at = self.pending.find(self.fmt.start)
        if at < 0:
            keep = held_suffix(self.pending, self.fmt.start)
            if len(self.pending) > keep:
                events.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
            return True
        if at:
            events.append(self.pending[:at])
        self.reader, self.raw = self.fmt.reader(self.schemas), ""
        self.pending = self.pending[at + len(self.fmt.start):]
        return False

    def _inside(self, events: list[Event]) -> bool:
        """The block's text to its reader, up to the end marker; True when more is needed."""
        assert self.reader is not None
        at = self.pending.find(self.fmt.end)
        cut = at if at >= 0 else len(self.pending) - held_suffix(self.pending, self.fmt.end)
        self.raw += self.pending[:cut]
        events += self.reader.feed(self.pending[:cut])
        if at < 0:
            self.pending = self.pending[cut:]
            return True
        closing = self.reader.close(True)
        events += (closing if closing is not None
                   else [self.fmt.start + self.raw + self.fmt.end])
        self.reader, self.pending = None, self.pending[at + len(self.fmt.end):]
        self.after_call = closing is not None
        return False

    def finish(self) -> list[Event]:
        """What is left at the end: held-back text, and a block cut off by the end of the
        output (a call ended where it stopped, or content if it held none)."""
        events: list[Event] = []
        if self.reader is not None:
            closing = self.reader.close(False)
            if closing is None:
                events.append(self.fmt.start + self.raw + self.pending)
            else:
                events += closing
            self.pending = ""
        if self.pending:
            events.append(self.pending)
        self.reader, self.pending = None, ""
        return events


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


def forced_reader(tools: list[dict[str, Any]]) -> JsonCalls:
    """The reader of a reply constrained by :func:`forced_schema` (an array of
    ``{"name", "parameters"}``)."""
    return JsonCalls(_schemas(tools), 2, ("parameters",))


def extract_forced(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """The calls of a whole forced reply; a reply that holds none (cut off before a name)
    stays content."""
    reader = forced_reader(tools)
    events: list[Event] = [*reader.feed(text)]
    closing = reader.close(True)
    return (text, []) if closing is None else assemble(events + closing)
