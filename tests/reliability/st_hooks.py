"""Schemathesis hooks (loaded through ``SCHEMATHESIS_HOOKS``) for the one rule an OpenAPI
document cannot state: a grammar, regex or JSON Schema must also be *valid* (and a request
carries at most one). The fuzzer's strings are kept when they compile and dropped when they
do not, so "schema-valid request rejected" stays a strict check on every other field; the
400s for invalid grammars are tested in ``tests/server/test_structured_outputs.py``.

Chat bodies get the same treatment for the cross-field rules of tool calls and templates:
a forced ``tool_choice`` (its tools' schemas become a grammar, and it must name one of the
tools) and ``continue_final_message`` (which needs an assistant message last and no
generation prompt) are dropped from the cases that break them; their 400s are tested in
``tests/server/test_tool_calls.py``. So is ``best_of`` below ``n`` (refused as OpenAI and vLLM
refuse it; tested in ``tests/server/test_bad_input.py``). Image parts and blocks, and chat
content parts of no type any API defines, are taken out of the messages: the served model
has no image encoder, and its 400 for them is tested in ``tests/server/test_image_parts.py``.
A session export's ``format=pth`` becomes the default: the served model has no state-file
format, and that 400 is tested in ``tests/server/test_rwkv_http.py``. A named initial
``state`` is taken out too: the server under test holds none (``--state-dir``), and its 400
for an unknown name is tested in ``tests/server/test_rwkv6_http.py``."""

from __future__ import annotations

from functools import cache
from typing import Any

import schemathesis
from pydantic import ValidationError

from bench.serverproc import ROOT
from linserve.model.tokenizer import Tokenizer
from linserve.server.api.protocol import CompletionRequest
from linserve.server.grammar.compiler import GrammarCompiler
from linserve.server.grammar.spec import GrammarError

CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar")


@cache
def compiler() -> GrammarCompiler:
    tok = Tokenizer.from_file(ROOT / "weights" / "tokenizer.json")
    return GrammarCompiler(tok, tok.vocab_size)


def compiles(field: str, value: Any, whitespace: Any) -> bool | None:
    """True: a valid constraint; False: schema-valid but it does not compile; None: not a
    constraint (or schema-invalid, which the request's own validation answers)."""
    body = {"prompt": "x", field: value, "guided_whitespace_pattern": whitespace}
    try:
        spec = CompletionRequest.model_validate(body).grammar_spec()
        if spec is None:
            return None
        compiler().template(spec)
    except ValidationError:
        return None
    except GrammarError:
        return False
    return True


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    """Applied in every phase (the coverage phase skips body-level hooks), to positive
    cases only: a negative case must stay as invalid as it was generated."""
    meta = getattr(case, "meta", None)
    if meta is not None and str(getattr(meta.generation.mode, "value", "")) == "negative":
        return case
    keep_valid(case)
    return case


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """``best_of`` below ``n`` and a thinking budget over ``max_tokens`` dropped again right
    before each call: the stateful phase edits cases after ``map_case`` (its links fill
    fields from earlier responses), and one sent it. The other agent rules are not re-applied: a
    link's ``previous_response_id`` names a response that exists, which is what that phase tests."""
    meta = getattr(case, "meta", None)
    if meta is not None and str(getattr(meta.generation.mode, "value", "")) == "negative":
        return
    keep_blob_export(case)
    if isinstance(case.body, dict):
        keep_valid_best_of(case.body)
        keep_valid_thinking(case.body)
        keep_text_only(case.body)
        case.body.pop("state", None)


def keep_valid(case: Any) -> None:
    """Every cross-field rule below, on a case's JSON body (and its query)."""
    keep_blob_export(case)
    if isinstance(case.body, dict):
        keep_valid_constraints(case.body)
        keep_valid_chat_rules(case.body)
        keep_valid_best_of(case.body)
        keep_valid_agent_rules(case.body)
        keep_text_only(case.body)
        case.body.pop("state", None)  # the server under test holds no named states


def keep_blob_export(case: Any) -> None:
    """A state export in this server's own format (the model under test has no state file)."""
    query = getattr(case, "query", None)
    if isinstance(query, dict) and query.get("format") == "pth":
        query["format"] = "safetensors"


TEXT_PARTS = ("text", "input_text", "output_text")


def _text_parts(content: Any) -> Any:
    """A message's content with only its text parts (a string stays as it is); an empty
    list becomes one short text."""
    if not isinstance(content, list):
        return content
    kept = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in (*TEXT_PARTS, "tool_use",
                                                                  "tool_result", "thinking",
                                                                  "redacted_thinking"):
            continue
        if part.get("type") == "tool_result":
            part = {**part, "content": _text_parts(part.get("content", ""))}
        kept.append(part)
    return kept or "x"


def keep_text_only(body: dict[str, Any]) -> None:
    """Every message's content without image parts or untyped ones (chat's ``messages``,
    the Responses API's ``input`` items, the Messages API's ``messages``)."""
    for key in ("messages", "input"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        for item in items:
            if isinstance(item, dict) and "content" in item and "role" in item:
                item["content"] = _text_parts(item["content"])


def keep_valid_agent_rules(body: dict[str, Any]) -> None:
    """The Responses and Messages APIs' cross-field rules: a stored response to continue
    (a random id is a 404), a schema that compiles, a tool_choice that names a tool, a
    thinking budget under max_tokens (their 400s: tests/server/test_responses_api.py and
    test_messages_api.py). A fuzzed response is stored (``store: false`` is not kept), so
    that the stateful phase finds what it created; unstored ones are tested there too."""
    body.pop("previous_response_id", None)
    if body.get("store") is False:
        del body["store"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        del body["tool_choice"]
    for outer, schema_of in (("text", _text_schema), ("output_config", _output_schema)):
        config = body.get(outer)
        schema = schema_of(config) if isinstance(config, dict) else None
        if schema is not None and compiles("response_format", {
                "type": "json_schema", "json_schema": {"schema": schema}}, None) is False:
            del body[outer]
    keep_valid_thinking(body)


def _number(v: Any) -> bool:
    """A JSON number as the schema's integers take it (whole floats such as ``8.0`` too)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def keep_valid_thinking(body: dict[str, Any]) -> None:
    """Drop a thinking budget that is not under ``max_tokens``, whichever numbers carry
    them (refused as Anthropic refuses it; tested in tests/server/test_messages_api.py)."""
    thinking, limit = body.get("thinking"), body.get("max_tokens")
    if isinstance(thinking, dict) and _number(thinking.get("budget_tokens")) and \
            _number(limit) and thinking["budget_tokens"] >= limit:
        del body["thinking"]


def _text_schema(config: dict[str, Any]) -> Any:
    fmt = config.get("format")
    return fmt.get("schema") if isinstance(fmt, dict) else None


def _output_schema(config: dict[str, Any]) -> Any:
    fmt = config.get("format")
    return fmt.get("schema") if isinstance(fmt, dict) else None


def keep_valid_best_of(body: dict[str, Any]) -> None:
    """Drop a ``best_of`` below ``n``, whichever JSON numbers carry them (the schema's
    integers take whole floats such as ``8.0`` too: an int-only check let the stateful phase
    send ``n: 8.0, best_of: 4``)."""
    best_of, n = body.get("best_of"), body.get("n", 1)
    if _number(best_of) and _number(n) and best_of < n:
        del body["best_of"]


def keep_valid_chat_rules(body: dict[str, Any]) -> None:
    if body.get("tool_choice") not in (None, "none", "auto"):
        del body["tool_choice"]
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if body.get("continue_final_message") and not (
            body.get("add_generation_prompt") is False and isinstance(last, dict)
            and last.get("role") == "assistant"):
        body["continue_final_message"] = False


def keep_valid_constraints(body: dict[str, Any]) -> None:
    kept = False
    for field in CONSTRAINTS:
        if body.get(field) is None:
            continue
        ok = compiles(field, body[field], body.get("guided_whitespace_pattern"))
        if ok is False or (ok and kept):
            del body[field]
        kept = kept or bool(ok)
