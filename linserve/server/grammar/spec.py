"""What a request constrains its output to, as plain data that crosses to the engine process.

The request fields (OpenAI's ``response_format``; vLLM's ``structured_outputs`` and its older
``guided_*`` extras) all become one :class:`GrammarSpec`, whose :meth:`~GrammarSpec.grammar`
is the llguidance grammar text. JSON is generated compactly (``{"a": 1, "b": [2, 3]}``: no
free whitespace, ``", "`` and ``": "`` separators) unless a whitespace pattern is given: a
small model given free whitespace tends to spend its tokens on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

if TYPE_CHECKING:  # a TypedDict that exists only in llguidance's type stubs
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
MAX_GRAMMAR_CHARS = 65_536
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A request's grammar is invalid; ``param`` names the field (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint. ``source``: a JSON Schema (as JSON text), a regex, a JSON list of
    choices, or a Lark/GBNF grammar; ``param`` is the request field it came from."""

    kind: Kind
    source: str
    param: str
    whitespace: str | None = None  # JSON only: a regex for the whitespace allowed between items

    def grammar(self) -> str:
        """The llguidance grammar text (raises :class:`GrammarError` on malformed input)."""
        if self.kind in ("json_schema", "json_object"):
            options: JsonCompileOptions = JSON_OPTIONS
            if self.whitespace is not None:
                options = {"whitespace_pattern": self.whitespace}
            try:
                return str(LLMatcher.grammar_from_json_schema(self.source, overrides=options))
            except ValueError as exc:
                raise GrammarError(f"invalid JSON schema: {exc}", self.param) from exc
        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.source))
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.source))
            return str(LLMatcher.grammar_from_lark(f"start: {alternatives}\n"))
        try:
            return str(LLMatcher.grammar_from_lark(any_to_lark(self.source)))
        except Exception as exc:  # the GBNF converter raises plain exceptions
            raise GrammarError(f"invalid grammar: {exc}", self.param) from exc


def _schema_text(value: Any, param: str) -> str:
    """A JSON Schema given as an object or as JSON text, as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}", param) from exc
    if not isinstance(value, dict | bool):
        raise GrammarError("a JSON schema must be an object", param)
    return json.dumps(value)  # key order kept: properties are generated in schema order


def _one(kind: Kind, value: Any, param: str, whitespace: str | None) -> GrammarSpec:
    """The spec of one vLLM-style constraint field."""
    if kind in ("json_schema", "json_object"):
        source = ANY_OBJECT if kind == "json_object" else _schema_text(value, param)
        return GrammarSpec(kind, source, param, whitespace)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise GrammarError("choices must be a non-empty list of non-empty strings", param)
        return GrammarSpec("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise GrammarError("must be a non-empty string", param)
    return GrammarSpec(kind, value, param)


GUIDED: dict[str, Kind] = {"guided_json": "json_schema", "guided_regex": "regex",
                           "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED: dict[str, Kind] = {"json": "json_schema", "regex": "regex", "choice": "choice",
                               "grammar": "grammar", "json_object": "json_object"}


def from_request(response_format: dict[str, Any] | None, fields: dict[str, Any]
                 ) -> GrammarSpec | None:
    """The one constraint a request asks for, or None. ``fields``: the request's
    ``structured_outputs`` and ``guided_*`` values (None when absent). More than one
    constraint is a :class:`GrammarError`."""
    found: list[GrammarSpec] = []
    ws = fields.get("guided_whitespace_pattern")
    if response_format is not None and response_format.get("type") == "json_object":
        found.append(_one("json_object", None, "response_format", ws))
    elif response_format is not None and response_format.get("type") == "json_schema":
        body = response_format.get("json_schema") or {}
        schema = body.get("schema")
        found.append(_one("json_schema", {"type": "object"} if schema is None else schema,
                          "response_format.json_schema.schema", ws))
    for name, kind in GUIDED.items():
        if fields.get(name) is not None:
            found.append(_one(kind, fields[name], name, ws))
    structured = fields.get("structured_outputs") or {}
    ws = structured.get("whitespace_pattern", ws)
    for name, kind in STRUCTURED.items():
        value = structured.get(name)
        if value is not None and value is not False:
            found.append(_one(kind, value, f"structured_outputs.{name}", ws))
    if len(found) > 1:
        raise GrammarError("give one output constraint, not several: "
                           + ", ".join(s.param for s in found), found[1].param)
    if found and len(found[0].source) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is longer than {MAX_GRAMMAR_CHARS} characters",
                           found[0].param)
    return found[0] if found else None
