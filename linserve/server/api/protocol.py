"""Request and response models of the OpenAI-compatible API (pydantic).

Requests tolerate unknown fields (real clients send vLLM extensions); known fields are
validated strictly, and every failure becomes a 400 in OpenAI's error envelope.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from linserve.model.sampling_params import SamplingParams
from linserve.server.api.tool_calls import forced_schema
from linserve.server.grammar.spec import GrammarError, GrammarSpec, from_request


# Token ids: non-negative integers (never bools or strings); the OpenAPI document gets the
# model's vocabulary size as their maximum (see ``linserve.server.api.openapi``).
def _json_integer(value: Any) -> Any:
    """JSON-Schema integers: 3 and 3.0 yes; true, "3" and 3.5 no."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


def _json_number(value: Any) -> Any:
    """JSON-Schema numbers: 3 and 3.5 yes; true and "3" no (pydantic's lax mode takes both)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    return value


Integer = Annotated[int, BeforeValidator(_json_integer)]
Number = Annotated[float, BeforeValidator(_json_number)]
TokenId = Annotated[int, BeforeValidator(_json_integer),
                    Field(ge=0, json_schema_extra={"x-token-id": True})]
StopString = Annotated[str, Field(min_length=1, max_length=256)]
MAX_N = 16  # choices per prompt
# Fields other servers implement that would change the output here (refused, not dropped).
REFUSED = ("suffix", "min_tokens", "use_beam_search", "functions", "prompt_logprobs",
           "include_stop_str_in_output", "bad_words", "allowed_token_ids",
           "truncate_prompt_tokens")
GrammarText = Annotated[str, Field(min_length=1, max_length=65_536)]
MAX_PROMPTS = 32  # prompts in one batched /v1/completions request


class OpenAIBase(BaseModel):
    """Base of every request model: unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBase):
    include_usage: StrictBool = False


class JsonSchemaFormat(OpenAIBase):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="the JSON Schema the reply must validate against "
        "(absent: any JSON object)")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBase):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(
        None, description="for type json_schema (absent: any JSON object)")


class StructuredOutputs(OpenAIBase):
    """vLLM's ``structured_outputs``: exactly one of its constraint fields."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON Schema")
    regex: GrammarText | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]],
                      Field(min_length=1, max_length=256)] | None = None
    grammar: GrammarText | None = Field(None, description="a Lark or GBNF grammar")
    json_object: StrictBool | None = None
    whitespace_pattern: GrammarText | None = None


class SamplingFields(OpenAIBase):
    """Fields shared by completions and chat completions."""

    # The refused fields are documented too (see server.api.openapi), so schema-based clients
    # and fuzzers know that only an empty value of them is accepted.
    model_config = ConfigDict(extra="allow", json_schema_extra={"x-refused": True})

    model: str | None = None
    max_tokens: Annotated[Integer, Field(ge=1)] | None = Field(
        None, json_schema_extra={"x-max-tokens": True})
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: Integer = Field(0, ge=-1, le=2**31 - 1)
    min_p: Number = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Number = Field(1.0, gt=0.0, le=10.0)
    seed: Annotated[Integer, Field(ge=0, le=2**53 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=8)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Integer = Field(1, ge=1, le=MAX_N, description="choices to sample; the prompt is "
                   "prefilled once and its state forked n ways")
    logit_bias: Annotated[dict[str, Annotated[Number, Field(ge=-100, le=100)]],
                          Field(max_length=300, json_schema_extra={"x-token-id-keys": True})
                          ] | None = Field(
        None, description="token id (as a string) → bias added to its logit; -100 bans the "
        "token, 100 all but forces it")
    user: str | None = Field(None, max_length=256)
    session_id: str | None = Field(None, max_length=128)
    state: str | None = Field(None, max_length=128, description="a named initial state the "
                              "server holds (--state-dir: RWKV's state-tuned files; "
                              "GET /v1/states lists them); not with session_id")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = Field(
        None, description="vLLM: a JSON Schema the output must validate against")
    guided_regex: GrammarText | None = Field(None, description="vLLM: a regex the whole "
                                             "output must match")
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]],
                             Field(min_length=1, max_length=256)] | None = Field(
        None, description="vLLM: the output is exactly one of these strings")
    guided_grammar: GrammarText | None = Field(None, description="vLLM: a Lark or GBNF "
                                               "grammar the output must follow")
    guided_whitespace_pattern: GrammarText | None = Field(
        None, description="vLLM: the whitespace allowed between JSON items (default none)")
    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> SamplingFields:
        """A field that would change the output but is not implemented is a 400 naming it,
        never silently dropped (harmless extras such as ``metadata`` stay ignored)."""
        extra = self.model_extra or {}
        for name in REFUSED:
            if extra.get(name) not in (None, False, [], {}):
                raise ValueError(f"{name} is not supported by this server")
        if self.structured_outputs is not None and (self.structured_outputs.model_extra or {}
                                                    ).get("structural_tag") is not None:
            raise ValueError("structured_outputs.structural_tag is not supported")
        return self

    def grammar_spec(self) -> GrammarSpec | None:
        """The output constraint asked for, if any (raises ``GrammarError``: a 400)."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in (
            "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "guided_whitespace_pattern")}
        if self.structured_outputs is not None:
            fields["structured_outputs"] = self.structured_outputs.model_dump(
                by_alias=True, exclude_none=True)
        fmt = self.response_format.model_dump(by_alias=True) if self.response_format else None
        return from_request(fmt, fields)

    def requested_max_tokens(self) -> int | None:
        """``max_tokens``, or chat's newer ``max_completion_tokens`` when that is given."""
        extra = getattr(self, "max_completion_tokens", None)
        return extra if extra is not None else self.max_tokens

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, max_tokens=max_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            logprobs=logprobs, logit_bias=self.bias_pairs())

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None
                                 ) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and key == str(int(key))):
                raise ValueError(f"key {key!r} is not a token id")
        return value

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as sorted (token id, bias) pairs."""
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow",
                              json_schema_extra={"required": ["prompt"], "x-refused": True})

    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        "", description="Text, token ids, or a batch of either (up to 32 prompts; choice "
        "i·n + j is sample j of prompt i). May be empty only with a session_id.")
    best_of: Annotated[Integer, Field(ge=1, le=MAX_N)] | None = Field(
        None, description="samples per prompt, of which the n with the highest total "
        "log-probability are returned (at least n; streamed only once all are done)")

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        """``best_of`` samples are ranked to return ``n``: fewer than ``n`` is refused, as
        OpenAI and vLLM refuse it."""
        n = info.data.get("n")
        if value is not None and isinstance(n, int) and value < n:
            raise ValueError(f"must be at least n ({n}), got {value}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _empty_prompt_in_session(cls, data: Any) -> Any:
        """With a session_id an empty prompt just continues the session."""
        if isinstance(data, dict) and data.get("session_id") and data.get("prompt") in ("", []):
            data = {k: v for k, v in data.items() if k != "prompt"}
        return data
    logprobs: Annotated[Integer, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one entry per prompt of a batch."""
        p: Any = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)
    return_tokens_as_token_ids: StrictBool = False  # vLLM extension: logprob tokens as "token_id:N"


class FunctionCall(OpenAIBase):
    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(OpenAIBase):
    """A tool call an earlier assistant turn made (sent back in the conversation)."""

    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


# Content-part types that carry an image, in each API's own shape once converted to chat's
# (chat's ``image_url``; the Responses API's ``input_image``; Anthropic's ``image``).
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


class ChatMessage(OpenAIBase):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")

    def input_kinds(self) -> list[str]:
        """What its content holds besides text, part by part ("image", or a part type this
        server does not know), in order."""
        if not isinstance(self.content, list):
            return []
        kinds = []
        for part in self.content:
            kind = str(part.get("type", "")) if isinstance(part, dict) else ""
            if kind not in TEXT_PARTS:
                kinds.append("image" if kind in IMAGE_PARTS else kind or "untyped")
        return kinds

    def for_template(self) -> dict[str, Any]:
        """As chat templates expect it (vLLM's convention): content-part arrays kept, tool
        call arguments as objects, not JSON text."""
        out = self.model_dump(exclude_none=True)
        for call in out.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str):
                try:
                    call["function"]["arguments"] = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ValueError("a tool call's arguments are not JSON") from None
        return out


class FunctionTool(OpenAIBase):
    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(OpenAIBase):
    type: Literal["function"] = "function"
    function: FunctionTool


class NamedToolChoice(OpenAIBase):
    class Name(OpenAIBase):
        name: str

    type: Literal["function"] = "function"
    function: Name


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'auto' (the default with tools), 'none', 'required' or a named "
        "function; the last two are enforced by a grammar")
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra template variables, e.g. {\"enable_thinking\": false}")
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    documents: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatRequest:
        choice = self.tool_choice
        names = {t.function.name for t in self.tools or []}
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not "
                             "among the tools")
        if self.continue_final_message and (self.add_generation_prompt or
                                            self.messages[-1].role != "assistant"):
            raise ValueError("continue_final_message needs add_generation_prompt false and "
                             "an assistant message last")
        return self

    def grammar_spec(self) -> GrammarSpec | None:
        """A forced tool call (``tool_choice`` required or named) is a JSON-schema constraint
        on the output (server.api.tool_calls.forced_schema), as vLLM enforces it."""
        forced, name = self.forced_tool()
        if not forced:
            return super().grammar_spec()
        if super().grammar_spec() is not None:
            raise GrammarError("tool_choice 'required' or a named function cannot be combined "
                               "with another output constraint", "tool_choice")
        schema = forced_schema(self.tool_dicts(), name, self.parallel_tool_calls)
        return from_request({"type": "json_schema", "json_schema": {
            "name": "tool_calls", "schema": schema}}, {})

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether a call is forced, the function it must call or None for any)."""
        if self.tool_choice == "required":
            return True, None
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return False, None
    max_completion_tokens: Annotated[Integer, Field(ge=1)] | None = Field(
        None, json_schema_extra={"x-max-tokens": True},
        description="what current OpenAI SDKs send; wins over max_tokens")
    logprobs: StrictBool = False
    top_logprobs: Annotated[Integer, Field(ge=0, le=20)] | None = None


class SessionCreate(OpenAIBase):
    prompt: str | list[TokenId] = ""
    state: str | None = Field(None, max_length=128, description="a named initial state "
                              "(--state-dir) the session starts from")


class TokenizeRequest(OpenAIBase):
    """Text (``prompt``), or a conversation rendered by the chat template (``messages``, as
    vLLM's /tokenize takes it): exactly one of the two."""

    model_config = ConfigDict(extra="allow", json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    prompt: str | SkipJsonSchema[None] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | SkipJsonSchema[None] = None
    tools: list[Tool] | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_of(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if ("prompt" in data) == ("messages" in data):
                raise ValueError("send either prompt or messages")
            if data.get("prompt", "") is None or data.get("messages", [0]) is None:
                raise ValueError("prompt and messages may not be null")
        return data


class DetokenizeRequest(OpenAIBase):
    tokens: list[TokenId]
    model: str | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorBody


class SessionInfo(BaseModel):
    id: str
    object: Literal["session"] = "session"
    tokens: int
    state_bytes: int
    model: str
    created: int
    last_used: int
    busy: bool = Field(False, description="a request is running on the session (it answers "
                       "409 to another until that one ends or is cancelled)")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
