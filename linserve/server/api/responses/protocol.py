"""Request models of the OpenAI Responses API (``POST /v1/responses``), validated as strictly
as the chat ones: every field either works or is a 400 naming it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, Tag, model_validator

from linserve.server.api.protocol import (
    FunctionTool,
    Integer,
    JsonSchemaFormat,
    Number,
    OpenAIBase,
)

# Fields of the Responses API this server does not implement: any non-empty value is a 400.
REFUSED = ("background", "conversation", "prompt", "max_tool_calls", "include",
           "top_logprobs", "context_management")
Text = Annotated[str, Field(max_length=4_000_000)]
ItemId = Annotated[str, Field(max_length=256)] | None


class TextPart(OpenAIBase):
    """A message's text: ``input_text`` (what a client says), ``output_text`` (an earlier
    reply resent) or ``text``."""

    type: Literal["input_text", "output_text", "text"]
    text: Text


class ImagePart(OpenAIBase):
    """An image in a message (``input_image``): a URL (``data:`` or http) or an uploaded
    file's id, and the detail to read it at."""

    type: Literal["input_image"]
    image_url: Annotated[str, Field(max_length=64_000_000)] | None = None
    file_id: str | None = Field(None, max_length=256)
    detail: Literal["auto", "low", "high"] | None = None

    def as_chat(self) -> dict[str, Any]:
        """The chat API's ``image_url`` part."""
        url: dict[str, Any] = {"url": self.image_url or f"file:{self.file_id or ''}"}
        if self.detail is not None:
            url["detail"] = self.detail
        return {"type": "image_url", "image_url": url}


def _part_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", "")
    return "image" if kind == "input_image" else "text"


Part = Annotated[Annotated[TextPart, Tag("text")] | Annotated[ImagePart, Tag("image")],
                 Discriminator(_part_type)]


class MessageItem(OpenAIBase):
    """A message: the short form ``{"role", "content"}`` or the ``type: message`` item."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[Part]
    id: ItemId = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as chat takes it: text, or parts where there is an image."""
        if isinstance(self.content, str) or all(isinstance(p, TextPart) for p in self.content):
            return self.text()
        return [p.as_chat() if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in self.content]


class FunctionCallItem(OpenAIBase):
    """A call an earlier reply made, sent back in the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: Text
    id: ItemId = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIBase):
    """A tool's result for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Text | list[TextPart]
    id: ItemId = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


class ReasoningPart(OpenAIBase):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(OpenAIBase):
    """An earlier reply's reasoning, sent back (it goes with the next assistant message)."""

    type: Literal["reasoning"]
    id: ItemId = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


class ResponseTool(FunctionTool):
    """A function tool, flat as the Responses API writes it (chat nests it in
    ``function``); built-in tools (web search, files, computer use) are not served."""

    type: Literal["function"]


class NamedFunction(OpenAIBase):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)


class TextFormat(JsonSchemaFormat):
    """``text.format``: free text, any JSON object, or JSON under ``schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(OpenAIBase):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(
        None, description="only the default: this server does not steer verbosity")


class ReasoningConfig(OpenAIBase):
    """``reasoning``: ``effort`` none or minimal turns thinking off, low to xhigh on, absent
    leaves the template's default; the reasoning comes back whole in a ``reasoning`` item's
    content (``summary`` is accepted and left empty, as vLLM does)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    def thinking(self) -> bool | None:
        if self.effort is None:
            return None
        return self.effort not in ("none", "minimal")


class ResponsesRequest(OpenAIBase):
    """``POST /v1/responses``."""

    model: str | None = None
    input: Text | Annotated[list[InputItem], Field(
        min_length=1, max_length=4096, json_schema_extra={"contains": {"not": {
            "type": "object", "properties": {"type": {"const": "reasoning"}},
            "required": ["type"]}}})] = Field(
        description="a string (one user message) or a list of items: messages, "
        "function_call and function_call_output items, reasoning items (at least one item "
        "that is not reasoning)")
    instructions: Text | None = Field(
        None, description="a system message before the input; with previous_response_id "
        "the stored conversation keeps its own, so a different one is a 400")
    previous_response_id: str | None = Field(
        None, max_length=256, description="continue a stored response: only the new input "
        "is prefilled, after its stored state")
    store: StrictBool = Field(True, description="keep the response and its state "
                              "(for previous_response_id and GET)")
    max_output_tokens: Annotated[Integer, Field(ge=1)] | None = Field(
        None, json_schema_extra={"x-max-tokens": True})
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    seed: Annotated[Integer, Field(ge=0, le=2**53 - 1)] | None = Field(
        None, description="an extension: seeded sampling, as in chat")
    tools: Annotated[list[ResponseTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    stream: StrictBool = False
    truncation: Literal["disabled"] | None = Field(
        None, description="only 'disabled': a conversation is never cut")
    user: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> ResponsesRequest:
        extra = self.model_extra or {}
        for name in REFUSED:
            if extra.get(name) not in (None, False, [], {}, 0):
                raise ValueError(f"{name} is not supported by this server")
        names = {t.name for t in self.tools or []}
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not "
                             "among the tools")
        return self

    @model_validator(mode="after")
    def _something_to_say(self) -> ResponsesRequest:
        if isinstance(self.input, list) and all(isinstance(i, ReasoningItem)
                                                for i in self.input):
            raise ValueError("input has only reasoning items: give a message or a tool result")
        return self

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem
                            | ReasoningItem]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

