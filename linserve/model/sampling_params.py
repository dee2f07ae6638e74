"""A request's sampling settings, torch-free: the HTTP process builds them, the engine's
sampler (:mod:`linserve.model.sampling`) applies them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI semantics; 0 / 1.0 mean 'off')."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
