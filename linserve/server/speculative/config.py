"""``--speculative-config``: vLLM's JSON keys, checked at start-up with one clear line."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SpeculativeConfig(BaseModel):
    """What to draft with and how many tokens (vLLM's ``--speculative-config`` keys).

    ``method``: ``ngram`` (prompt lookup: the continuation of the last n tokens' latest earlier
    occurrence, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), ``draft_model``
    (greedy drafts of ``model``, a checkpoint this server loads, with the same vocabulary) or
    ``mtp`` (the checkpoint's own multi-token-prediction layers). ``max_batch`` (ours):
    speculate only while at most this many requests decode together, since a bigger step is
    compute-bound on a CPU and verifying drafts there costs more than it saves. ``adaptive``
    (ours): size each request's drafts by its acceptance and the measured cost of a verify
    (:mod:`.acceptance`); false drafts ``num_speculative_tokens`` every step."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft_model", "mtp"]
    num_speculative_tokens: int = Field(ge=1, le=16)
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    prompt_lookup_min: int = Field(2, ge=1, le=64)
    model: str | None = None
    max_batch: int = Field(4, ge=1, le=1024)
    adaptive: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError('method "draft_model" needs "model": a folder or hub id')
        if self.method != "draft_model" and self.model:
            raise ValueError(f'"model" is for method "draft_model", not "{self.method}"')
        return self

    def describe(self) -> str:
        """One line for the startup log and ``/health``."""
        k = self.num_speculative_tokens
        if self.method == "ngram":
            return (f"ngram, up to {k} tokens, lookup n={self.prompt_lookup_min}.."
                    f"{self.prompt_lookup_max}, batches of at most {self.max_batch}")
        what = "mtp (the checkpoint's MTP layers)" if self.method == "mtp" \
            else f"draft_model {self.model}"
        return f"{what}, up to {k} tokens, batches of at most {self.max_batch}"


def parse(text: str) -> SpeculativeConfig | None:
    """The config in ``text`` (JSON; empty: None). Raises ``ValueError`` with one line."""
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--speculative-config must be a JSON object")
    try:
        return SpeculativeConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise ValueError(f"--speculative-config: {where + ': ' if where else ''}{msg}") from None
