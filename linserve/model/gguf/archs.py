"""llama.cpp's architectures as the Hugging Face checkpoints they were converted from.

For each ``general.architecture`` served, a :class:`GGUFArch` gives back what llama.cpp's
converter (``convert_hf_to_gguf.py`` and its ``conversion/*.py``) turned into metadata and
tensors: the ``config.json`` the family reads (:attr:`GGUFArch.config`), fixes to tensor
names where the converter renamed one (:attr:`GGUFArch.rename`), and the inverse of every
change it made to a tensor's values or layout (:attr:`GGUFArch.transform`). Tensor names
themselves come back through gguf-py's own map (:func:`hf_candidates`), so the families'
Hugging Face name rules serve GGUF files unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import gguf
import torch

from linserve.model.gguf.files import GGUFModel

Transform = Callable[[str, torch.Tensor, dict[str, Any]], torch.Tensor]


def _keep(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    del name, cfg
    return t


def _same(name: str) -> str:
    return name


@dataclass(frozen=True)
class GGUFArch:
    """``config``: the Hugging Face config dict for a file's metadata (raises KeyError
    naming a missing key). ``rename``: a Hugging Face tensor name as gguf-py's map gives it,
    as the checkpoint had it. ``transform``: a tensor as read (PyTorch's shape order) back
    to the checkpoint's values, given its Hugging Face name and the config."""

    name: str
    config: Callable[[GGUFModel], dict[str, Any]]
    rename: Callable[[str], str] = _same
    transform: Transform = _keep


@lru_cache(maxsize=8)
def hf_candidates(arch: str, blocks: int) -> dict[str, tuple[str, ...]]:
    """GGUF base name (``blk.3.attn_qkv``) -> the Hugging Face names gguf-py maps to it, for
    an architecture of ``blocks`` blocks."""
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], blocks)
    inverse: dict[str, list[str]] = {}
    for hf_name, (_, gguf_name) in table.mapping.items():
        inverse.setdefault(gguf_name, []).append(hf_name)
    return {k: tuple(v) for k, v in inverse.items()}


def arch_enum(model: GGUFModel) -> str:
    """gguf-py's MODEL_ARCH member name for the file's architecture."""
    for member, name in gguf.MODEL_ARCH_NAMES.items():
        if name == model.arch:
            return member.name
    raise KeyError(f"general.architecture {model.arch!r}")


def _common(m: GGUFModel, model_type: str) -> dict[str, Any]:
    """The fields every family reads, from the file's metadata."""
    vocab = m.get("vocab_size") or len(m.meta.get("tokenizer.ggml.tokens") or []) \
        or m.tensors["token_embd.weight"].shape[0]
    return {"model_type": model_type, "vocab_size": int(vocab),
            "hidden_size": int(m.require("embedding_length")),
            "num_hidden_layers": int(m.require("block_count"))
            - int(m.get("nextn_predict_layers", 0)),
            "max_position_embeddings": int(m.get("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in m.tensors,
            "eos_token_id": m.meta.get("tokenizer.ggml.eos_token_id")}


def _per_layer(value: Any, n: int) -> list[int]:
    """A per-layer metadata value (a list, or one number for every layer)."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n


# ---- Qwen3.5 (qwen35) --------------------------------------------------------------------


def _qwen35_config(m: GGUFModel) -> dict[str, Any]:
    c = _common(m, "qwen3_5_text")
    n = c["num_hidden_layers"]
    recurrent = list(m.require("attention.recurrent_layers"))[:n]
    head_dim = int(m.get("attention.key_length") or c["hidden_size"]
                   // int(m.require("attention.head_count")))
    value_heads = int(m.require("ssm.time_step_rank"))
    return {**c,
            "intermediate_size": int(m.get("feed_forward_length", 0)),
            "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
            "num_attention_heads": int(m.require("attention.head_count")),
            "num_key_value_heads": max(_per_layer(m.require("attention.head_count_kv"), n)),
            "head_dim": head_dim,
            "linear_num_key_heads": int(m.require("ssm.group_count")),
            "linear_num_value_heads": value_heads,
            "linear_key_head_dim": int(m.require("ssm.state_size")),
            "linear_value_head_dim": int(m.require("ssm.inner_size")) // value_heads,
            "linear_conv_kernel_dim": int(m.require("ssm.conv_kernel")),
            "rms_norm_eps": float(m.require("attention.layer_norm_rms_epsilon")),
            "rope_parameters": {
                "rope_theta": float(m.get("rope.freq_base", 10_000_000.0)),
                "partial_rotary_factor": int(m.get("rope.dimension_count", head_dim // 4))
                / head_dim}}


def _qwen35_rename(name: str) -> str:
    # the converter wrote Gated DeltaNet's dt_bias as a bias of dt_proj (ssm_dt.bias)
    return name.replace(".linear_attn.dt_proj.bias", ".linear_attn.dt_bias")


def _untile_v_heads(t: torch.Tensor, dim: int, cfg: dict[str, Any], head_dim: int
                    ) -> torch.Tensor:
    """Undo the converter's reordering of value heads along ``dim`` (``_reorder_v_heads``):
    from tiled order [K0, K1, …, K0, K1, …] back to grouped by key head."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if nk == nv:
        return t
    dim %= t.dim()
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nv // nk, nk, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _qwen35_transform(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """The inverse of ``Qwen3NextModel`` / ``_LinearAttentionVReorderBase.modify_tensors``."""
    if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
        t = t - 1  # written as 1 + w: Qwen's RMSNorm scales by (1 + w)
    if ".linear_attn." not in name:
        return t
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    qk = 2 * dk * cfg["linear_num_key_heads"]
    if name.endswith(".A_log"):
        t = torch.log(-t)  # written as -exp(A_log)
    if re.search(r"\.(A_log|dt_bias|in_proj_a\.weight|in_proj_b\.weight)$", name):
        return _untile_v_heads(t, 0, cfg, 1)
    if name.endswith(".in_proj_z.weight"):
        return _untile_v_heads(t, 0, cfg, dv)
    if name.endswith(".out_proj.weight"):
        return _untile_v_heads(t, 1, cfg, dv)
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        t = torch.cat([t[:qk], _untile_v_heads(t[qk:], 0, cfg, dv)])
        return t.unsqueeze(1) if name.endswith(".conv1d.weight") else t  # [C, K] -> [C, 1, K]
    return t


# ---- LFM2 (lfm2) -------------------------------------------------------------------------


def _lfm2_config(m: GGUFModel) -> dict[str, Any]:
    c = _common(m, "lfm2")
    n = c["num_hidden_layers"]
    kv = _per_layer(m.require("attention.head_count_kv"), n)
    return {**c,
            "intermediate_size": int(m.require("feed_forward_length")),
            "block_auto_adjust_ff_dim": False,
            "layer_types": ["full_attention" if h else "conv" for h in kv],
            "num_attention_heads": int(m.require("attention.head_count")),
            "num_key_value_heads": max(kv),
            "norm_eps": float(m.require("attention.layer_norm_rms_epsilon")),
            "rope_parameters": {"rope_theta": float(m.get("rope.freq_base", 1_000_000.0))},
            "conv_L_cache": int(m.require("shortconv.l_cache")),
            "conv_bias": any(k.endswith("shortconv.conv.bias") for k in m.tensors)}


def _lfm2_transform(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    del cfg
    return t.unsqueeze(1) if name.endswith(".conv.conv.weight") else t  # [C, K] -> [C, 1, K]


ARCHS: dict[str, GGUFArch] = {a.name: a for a in (
    GGUFArch("qwen35", _qwen35_config, _qwen35_rename, _qwen35_transform),
    GGUFArch("lfm2", _lfm2_config, transform=_lfm2_transform),
)}


def arch_of(model: GGUFModel) -> GGUFArch:
    """The served architecture of ``model``; KeyError naming it when not served."""
    if model.arch not in ARCHS:
        raise KeyError(f"architecture {model.arch!r} is not served from GGUF files (these "
                       f"are: {', '.join(sorted(ARCHS))})")
    return ARCHS[model.arch]
