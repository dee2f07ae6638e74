"""Tiny random Qwen3.5 checkpoints made at test time with ``transformers`` (the reference),
saved with ``save_pretrained`` in the published format.

By default they carry a real Qwen-family tokenizer (151,936 ids, built from llama.cpp's
``ggml-vocab-qwen35.gguf``, :mod:`tests.model.llamacpp_assets`) and Qwen3.5's own chat
template, as a published instruct checkpoint does. ``tokenizer="project"`` gives the
project's 8,192-token Shakespeare tokenizer instead (smaller, for model-level tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.llamacpp_assets import QWEN_VOCAB, write_qwen_tokenizer_files
from tests.paths import ROOT

TOKENIZER = ROOT / "weights" / "tokenizer.json"

# interval: a full-attention layer every `interval` layers; heads: (q heads, kv heads);
# linear: (key heads, value heads, key dim, value dim)
SHAPES: dict[str, dict[str, Any]] = {
    "i4-tied": {"interval": 4, "layers": 4, "heads": (4, 2), "head_dim": 32,
                "linear": (2, 4, 16, 16), "tie": True},
    "i2-untied": {"interval": 2, "layers": 4, "heads": (4, 1), "head_dim": 16,
                  "linear": (2, 2, 32, 16), "tie": False},
    "i3-gqa": {"interval": 3, "layers": 6, "heads": (6, 3), "head_dim": 24,
               "linear": (1, 3, 24, 32), "tie": True},
}
# Head sizes of the published checkpoints' order, for the native kernels' register-blocked
# paths (column blocks of 64 and 16 and a scalar tail: head_dim 80, value heads of 136;
# four query heads a key-value head). Used by the native-step tests only.
KERNEL_SHAPES: dict[str, dict[str, Any]] = {
    "wide": {"interval": 2, "layers": 2, "heads": (8, 2), "head_dim": 80,
             "linear": (1, 2, 128, 136), "tie": True},
}


def text_config(shape: dict[str, Any], vocab: int = 8192) -> Any:
    transformers = pytest.importorskip("transformers")
    kq, kv, dk, dv = shape["linear"]
    n = shape["layers"]
    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=n,
        num_attention_heads=shape["heads"][0], num_key_value_heads=shape["heads"][1],
        head_dim=shape["head_dim"], linear_num_key_heads=kq, linear_num_value_heads=kv,
        linear_key_head_dim=dk, linear_value_head_dim=dv, max_position_embeddings=4096,
        tie_word_embeddings=shape["tie"],
        layer_types=["full_attention" if (i + 1) % shape["interval"] == 0
                     else "linear_attention" for i in range(n)])


# Vision towers of the tiny vision-language checkpoints (transformers' Qwen3_5VisionConfig
# fields; out_hidden_size is the text model's width).
VISION_SHAPES: dict[str, dict[str, Any]] = {
    "v1": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2},
    "v2": {"depth": 2, "hidden_size": 48, "intermediate_size": 80, "num_heads": 3,
           "num_position_embeddings": 256},
}
# The image processor's limits of those checkpoints: 64² to 256² pixels (4 to 64 tokens).
IMAGE_PIXELS = {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}
# The image tokens' ids: the Qwen tokenizer's own, or free ids of the project's.
IMAGE_IDS = {"qwen": {"image_token_id": 151655, "video_token_id": 151656,
                      "vision_start_token_id": 151652, "vision_end_token_id": 151653},
             "project": {"image_token_id": 8000, "video_token_id": 8001,
                         "vision_start_token_id": 8002, "vision_end_token_id": 8003}}


def write_processor(path: Path, pixels: dict[str, int] | None = None) -> None:
    """A ``preprocessor_config.json`` as Qwen3.5 ships it (transformers' PIL processor)."""
    transformers = pytest.importorskip("transformers")
    proc = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil
    proc(patch_size=16, merge_size=2, temporal_patch_size=2, size=pixels or IMAGE_PIXELS,
         image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]).save_pretrained(path)


def make_checkpoint(path: Path, name: str, vision: bool | str = False, seed: int = 0,
                    tokenizer: str = "qwen", scale: float = 4.0) -> Path:
    """Save a random-weight Qwen3.5 of shape ``SHAPES[name]`` (the vision-language wrapper
    with ``vision``: True or a ``VISION_SHAPES`` name, with its image processor's config)
    with a tokenizer (``"qwen"`` or ``"project"``), chat template and
    generation config, its matrices ``scale`` times transformers' initialisation; returns
    the folder."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    shape = {**SHAPES, **KERNEL_SHAPES}[name]
    cfg = text_config(shape, QWEN_VOCAB if tokenizer == "qwen" else 8192)
    if vision:
        tower = VISION_SHAPES[vision if isinstance(vision, str) else "v1"]
        full = transformers.Qwen3_5Config(
            text_config=cfg.to_dict(), tie_word_embeddings=shape["tie"],
            vision_config={**tower, "out_hidden_size": 64}, **IMAGE_IDS[tokenizer])
        model = transformers.Qwen3_5ForConditionalGeneration(full)
    else:
        model = transformers.Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():  # larger than init, so layers matter and decays vary
        for p in model.parameters():
            p.mul_(scale if p.dim() > 1 else 1.0)
    model.eval().save_pretrained(path)
    if vision:
        write_processor(path)
    if tokenizer == "qwen":
        write_qwen_tokenizer_files(path)
    else:
        shutil.copy(TOKENIZER, path / "tokenizer.json")
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return path


def reference(path: Path) -> Any:
    """The checkpoint loaded by transformers, fp32, eval."""
    transformers = pytest.importorskip("transformers")
    cls = (transformers.Qwen3_5ForConditionalGeneration
           if json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5"
           else transformers.Qwen3_5ForCausalLM)
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def add_mtp(path: Path, seed: int = 0) -> Path:
    """Give a saved checkpoint one MTP layer as Qwen's published ones carry it: ``mtp.fc``
    (random), its norms (zeros: scale 1, stored as w − 1) and ``mtp.layers.0.*`` copied from
    the last full-attention layer; ``mtp_num_hidden_layers: 1`` in the config."""
    from safetensors.torch import load_file, save_file
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    prefix = "model.language_model." if cfg["model_type"] == "qwen3_5" else "model."
    last = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    d = int(text["hidden_size"])
    g = torch.Generator().manual_seed(seed)
    layer = f"{prefix}layers.{last}."
    for name, t in list(tensors.items()):
        if name.startswith(layer):
            tensors["mtp.layers.0." + name.removeprefix(layer)] = t.clone()
    dtype = tensors[f"{prefix}norm.weight"].dtype
    tensors["mtp.fc.weight"] = (torch.randn(d, 2 * d, generator=g) / (2 * d) ** 0.5).to(dtype)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(d, dtype=dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
