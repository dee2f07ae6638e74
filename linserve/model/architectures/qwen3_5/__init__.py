"""Qwen3.5 and Qwen3.5-MoE (and the layers Qwen3-Next shares): :mod:`.layers` the decoder
layers, :mod:`.mtp` the multi-token-prediction layers, :mod:`.model` the text model, its
native step and the checkpoint formats it serves."""

from linserve.model.architectures.qwen3_5.layers import (
    DecoderLayer,
    GatedAttention,
    Qwen35Config,
    QwenExperts,
)
from linserve.model.architectures.qwen3_5.model import (
    FAMILY,
    MtpHead,
    Qwen35ForCausalLM,
)
from linserve.model.architectures.qwen3_5.mtp import QwenMTP

__all__ = ["FAMILY", "DecoderLayer", "GatedAttention", "MtpHead",
           "Qwen35Config", "Qwen35ForCausalLM", "QwenExperts", "QwenMTP"]
