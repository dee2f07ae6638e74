"""Request and response models of the OpenAI-compatible API (pydantic).

Requests tolerate unknown fields (real clients send vLLM extensions); known fields are
validated strictly, and every failure becomes a 400 in OpenAI's error envelope.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from model.sampling import SamplingParams


class OpenAIBase(BaseModel):
    """Base of every request model: unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBase):
    include_usage: bool = False


class SamplingFields(OpenAIBase):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = Field(None, max_length=256)
    session_id: str | None = Field(None, max_length=128)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 8 or any(len(s) == 0 or len(s) > 256 for s in stops):
            raise ValueError("stop takes at most 8 non-empty strings of up to 256 characters")
        return value

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
            logprobs=logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = ""
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM extension: logprob tokens as "token_id:N"

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, list) and value and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("only one prompt per request is supported")
        return value


class ChatMessage(OpenAIBase):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class SessionCreate(OpenAIBase):
    prompt: str | list[int] = ""


class TokenizeRequest(OpenAIBase):
    prompt: str | None = None
    text: str | None = None
    model: str | None = None


class DetokenizeRequest(OpenAIBase):
    tokens: list[int]
    model: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """``text_completion`` (also the shape of each streamed chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    session_id: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[str, Any]
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    session_id: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
