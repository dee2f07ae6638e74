"""Request models of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``): every field either works or is a 400 naming it."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, Tag, model_validator

from linserve.server.api.protocol import Integer, Number, OpenAIBase

Text = Annotated[str, Field(max_length=4_000_000)]
# Fields of the Messages API this server does not implement: any non-empty value is a 400.
REFUSED = ("container", "mcp_servers", "context_management")


class TextBlock(OpenAIBase):
    type: Literal["text"]
    text: Text


class ImageBlock(OpenAIBase):
    """An image: ``source`` is ``{"type": "base64", "media_type", "data"}`` or
    ``{"type": "url", "url"}``."""

    type: Literal["image"]
    source: dict[str, Any]

    def as_chat(self) -> dict[str, Any]:
        """The chat API's ``image_url`` part (a base64 source as a ``data:`` URL)."""
        src = self.source
        if src.get("type") == "base64":
            url = f"data:{src.get('media_type', '')};base64,{src.get('data', '')}"
        else:
            url = str(src.get("url", ""))
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlock(OpenAIBase):
    """A call the assistant made (sent back in the conversation)."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]


class ToolResultBlock(OpenAIBase):
    """A tool's result, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: Text | list[TextBlock | ImageBlock] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(
            b.text for b in self.content if isinstance(b, TextBlock))
        return f"Error: {body}" if self.is_error else body

    def images(self) -> list[ImageBlock]:
        return [] if isinstance(self.content, str) else [
            b for b in self.content if isinstance(b, ImageBlock)]


class ThinkingBlock(OpenAIBase):
    """An earlier reply's thinking, sent back (it goes with its assistant message)."""

    type: Literal["thinking"]
    thinking: Text
    signature: str | None = None


class RedactedThinkingBlock(OpenAIBase):
    type: Literal["redacted_thinking"]
    data: str


def _block_type(value: Any) -> str:
    return str(value.get("type") if isinstance(value, dict) else getattr(value, "type", ""))


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type)]


class Message(OpenAIBase):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(min_length=1)]

    def blocks(self) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(OpenAIBase):
    """A client tool (``custom``, the default); Anthropic's server tools are not served."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(OpenAIBase):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, max_length=128)
    disable_parallel_tool_use: StrictBool = False


class Thinking(OpenAIBase):
    """``thinking``: enabled turns the template's thinking on (the reasoning parser gives
    ``thinking`` blocks); ``budget_tokens`` is a target, as Anthropic documents it, and the
    thinking counts against ``max_tokens``."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[Integer, Field(ge=1)] | None = None
    display: Literal["summarized"] | None = Field(
        None, description="only 'summarized': the thinking is returned as written")


class OutputFormat(OpenAIBase):
    """``output_config.format``: structured outputs, the reply held to ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIBase):
    """``output_config``: ``format`` constrains the reply; ``effort`` is accepted (a hint
    this server's models do not take)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(OpenAIBase):
    user_id: str | None = Field(None, max_length=256)


class MessagesRequest(OpenAIBase):
    """``POST /v1/messages``."""

    model: str = Field(max_length=256)
    max_tokens: Annotated[Integer, Field(ge=1)] = Field(json_schema_extra={"x-max-tokens": True})
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: Text | list[TextBlock] | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]],
                              Field(max_length=8)] | None = None
    temperature: Number = Field(1.0, ge=0.0, le=1.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Annotated[Integer, Field(ge=0)] | None = None
    seed: Annotated[Integer, Field(ge=0, le=2**53 - 1)] | None = Field(
        None, description="an extension: seeded sampling, as in chat")
    metadata: Metadata | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    stream: StrictBool = False
    service_tier: Literal["auto", "standard_only"] | None = None

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        extra = self.model_extra or {}
        for name in REFUSED:
            if extra.get(name) not in (None, [], {}):
                raise ValueError(f"{name} is not supported by this server")
        choice = self.tool_choice
        names = {t.name for t in self.tools or []}
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        if self.thinking is not None and self.thinking.type == "enabled" and (
                self.thinking.budget_tokens or 0) >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n\n".join(b.text for b in self.system) or None


class CountTokensRequest(OpenAIBase):
    """``POST /v1/messages/count_tokens``: the prompt fields of a Messages request."""

    model: str = Field(max_length=256)
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def as_request(self) -> MessagesRequest:
        """A Messages request of these (validated) fields."""
        return MessagesRequest.model_construct(
            model=self.model, messages=self.messages, system=self.system, tools=self.tools,
            tool_choice=self.tool_choice, thinking=self.thinking, max_tokens=1 << 30)


def arguments(block: ToolUseBlock) -> str:
    return json.dumps(block.input, ensure_ascii=False)
