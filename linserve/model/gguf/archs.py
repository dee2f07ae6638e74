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


Combine = Callable[[list[torch.Tensor], dict[str, Any]], torch.Tensor]


@dataclass(frozen=True)
class Merge:
    """GGUF tensors the converter split from one checkpoint tensor: ``parts`` (GGUF names
    with ``{n}`` for the block) concatenated along ``dim`` make ``into`` (its Hugging Face
    name), or put together by ``combine`` (given the parts and the config)."""

    parts: tuple[str, ...]
    into: str
    dim: int = 0
    combine: Combine | None = None

    def join(self, parts: list[torch.Tensor], cfg: dict[str, Any]) -> torch.Tensor:
        return torch.cat(parts, self.dim) if self.combine is None else self.combine(parts, cfg)


@dataclass(frozen=True)
class GGUFArch:
    """``config``: the Hugging Face config dict for a file's metadata (raises KeyError
    naming a missing key). ``rename``: a Hugging Face tensor name as gguf-py's map gives it,
    as the checkpoint had it. ``transform``: a tensor as read (PyTorch's shape order) back
    to the checkpoint's values, given its Hugging Face name and the config (a shape the
    converter only squeezed or flattened is put back by the loader, which knows the shape
    it wants). ``merges``: tensors to put back together. ``names``: names gguf-py's map
    does not give, as regular expressions over GGUF names and their replacements."""

    name: str
    config: Callable[[GGUFModel], dict[str, Any]]
    rename: Callable[[str], str] = _same
    transform: Transform = _keep
    merges: Callable[[dict[str, Any]], tuple[Merge, ...]] = lambda cfg: ()
    names: tuple[tuple[str, str], ...] = ()  # (GGUF name, Hugging Face name) gguf-py lacks


@lru_cache(maxsize=8)
def hf_candidates(arch: str | None, blocks: int) -> dict[str, tuple[str, ...]]:
    """GGUF base name (``blk.3.attn_qkv``) -> the Hugging Face names gguf-py maps to it, for
    an architecture of ``blocks`` blocks (none for one gguf-py does not know: its
    :attr:`GGUFArch.names` give them all)."""
    if arch is None:
        return {}
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], blocks)
    inverse: dict[str, list[str]] = {}
    for hf_name, (_, gguf_name) in table.mapping.items():
        inverse.setdefault(gguf_name, []).append(hf_name)
    return {k: tuple(v) for k, v in inverse.items()}


def arch_enum(model: GGUFModel) -> str | None:
    """gguf-py's MODEL_ARCH member name for the file's architecture (None: one this gguf-py
    does not know, such as ``bailingmoe3``)."""
    for member, name in gguf.MODEL_ARCH_NAMES.items():
        if name == model.arch:
            return member.name
    return None


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


def _has(m: GGUFModel, i: int, *names: str) -> bool:
    """Whether block ``i`` has any of the tensors ``names`` (without ``blk.i.``)."""
    return any(f"blk.{i}.{name}" in m.tensors for name in names)


def _ssm_a(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """Mamba's A_log, which the converters write as A = −exp(A_log)."""
    del cfg
    return torch.log(-t) if name.endswith("A_log") else t


def _unpermute_qk(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """Undo ``LlamaModel.permute``, which reorders each head of q_proj and k_proj from
    rotate-half pairs to llama.cpp's interleaved pairs."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        heads = cfg["num_attention_heads"]
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = cfg["num_key_value_heads"]
    else:
        return t
    shape = t.shape
    return (t.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2)
            .reshape(shape))


def _granite_transform(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    return _unpermute_qk(name, _ssm_a(name, t, cfg), cfg)


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
                / head_dim},
            # MTP layers, written as the blocks past the model's (_QwenMtpMixin)
            "mtp_num_hidden_layers": int(m.get("nextn_predict_layers", 0) or 0),
            **_qwen_experts(m)}


def _qwen_experts(m: GGUFModel) -> dict[str, Any]:
    """Qwen3.5-MoE's expert fields (none for a dense file)."""
    if not m.get("expert_count"):
        return {}
    return {"model_type": "qwen3_5_moe_text", "num_experts": int(m.require("expert_count")),
            "num_experts_per_tok": int(m.require("expert_used_count")),
            "moe_intermediate_size": int(m.require("expert_feed_forward_length")),
            "shared_expert_intermediate_size":
                int(m.get("expert_shared_feed_forward_length", 0)),
            "norm_topk_prob": True}


def _dt_bias(name: str) -> str:
    """Mamba2's and Gated DeltaNet's dt_bias, which the converters write as a bias of a
    dt_proj that does not exist (ssm_dt.bias)."""
    return re.sub(r"\.dt_proj\.bias$", ".dt_bias", name)


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
    t = _qwen3next_transform(name, t, cfg)
    if ".linear_attn." not in name:
        return t
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    qk = 2 * dk * cfg["linear_num_key_heads"]
    if re.search(r"\.(A_log|dt_bias|in_proj_a\.weight|in_proj_b\.weight)$", name):
        return _untile_v_heads(t, 0, cfg, 1)
    if name.endswith(".in_proj_z.weight"):
        return _untile_v_heads(t, 0, cfg, dv)
    if name.endswith(".out_proj.weight"):
        return _untile_v_heads(t, 1, cfg, dv)
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        if cfg["linear_num_key_heads"] != cfg["linear_num_value_heads"]:  # (else as it is)
            t = torch.cat([t[:qk], _untile_v_heads(t[qk:], 0, cfg, dv)])
        return t.unsqueeze(1) if name.endswith(".conv1d.weight") else t  # [C, K] -> [C, 1, K]
    return t


# ---- Qwen3-Next (qwen3next) --------------------------------------------------------------


def _qwen3next_config(m: GGUFModel) -> dict[str, Any]:
    # Qwen3-Next's published checkpoints renormalise the top-k (llama.cpp assumes it)
    return {**_qwen35_config(m), **_qwen_experts(m), "model_type": "qwen3_next",
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen3next_transform(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """The inverse of ``Qwen3NextModel.modify_tensors`` (values; in_proj_qkvz is a merge)."""
    del cfg
    if (name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_")) \
            and ".linear_attn.norm." not in name:
        return t - 1  # written as 1 + w: Qwen's RMSNorm scales by (1 + w)
    if name.endswith(".A_log"):
        return torch.log(-t)  # written as -exp(A_log)
    return t


def _qkvz(parts: list[torch.Tensor], cfg: dict[str, Any]) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz from the converter's qkv and z: per key head, its q, k, v
    and z rows in turn."""
    qkv, z = parts
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    width = qkv.shape[-1]
    q, k, v = qkv.split([nk * dk, nk * dk, qkv.shape[0] - 2 * nk * dk])
    heads = [x.reshape(nk, -1, width) for x in (q, k, v, z)]
    return torch.cat(heads, 1).reshape(-1, width)


_QWEN3NEXT_MERGES = (Merge(("blk.{n}.attn_qkv.weight", "blk.{n}.attn_gate.weight"),
                           "model.layers.{n}.linear_attn.in_proj_qkvz.weight", combine=_qkvz),)


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


def _lfm2moe_config(m: GGUFModel) -> dict[str, Any]:
    return {**_lfm2_config(m), "model_type": "lfm2_moe",
            "num_experts": int(m.require("expert_count")),
            "num_experts_per_tok": int(m.require("expert_used_count")),
            "moe_intermediate_size": int(m.require("expert_feed_forward_length")),
            "num_dense_layers": int(m.get("leading_dense_block_count", 0)),
            "use_expert_bias": any(k.endswith("exp_probs_b.bias") for k in m.tensors),
            "norm_topk_prob": True,
            "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0))}


def _lfm2_transform(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    del cfg
    return t.unsqueeze(1) if name.endswith(".conv.conv.weight") else t  # [C, K] -> [C, 1, K]


# ---- Granite-4.0-H (granitehybrid) -------------------------------------------------------


def _granite_config(m: GGUFModel) -> dict[str, Any]:
    """Granite-4.0-H, or Bamba, which the converter writes as the same architecture with
    RoPE (``rope.scaling.finetuned``: Granite's converter never turns it on for a hybrid)."""
    if m.get("rope.scaling.finetuned"):
        return _bamba_config(m)
    c = _common(m, "granitemoehybrid")
    n = c["num_hidden_layers"]
    d = c["hidden_size"]
    heads = int(m.require("attention.head_count"))
    experts = int(m.get("expert_count", 0) or 0)
    kv = [h for h in _per_layer(m.require("attention.head_count_kv"), n) if h]
    return {**c,
            "layer_types": ["attention" if _has(m, i, "attn_q.weight") else "mamba"
                            for i in range(n)],
            "num_attention_heads": heads,
            "num_key_value_heads": max(kv) if kv else _attention_kv(m, heads),
            "head_dim": d // heads,
            "position_embedding_type": "rope" if m.get("rope.scaling.finetuned") else "nope",
            "rope_parameters": {"rope_theta": float(m.get("rope.freq_base", 10_000.0))},
            "attention_multiplier": float(m.get("attention.scale", (d // heads) ** -0.5)),
            "embedding_multiplier": float(m.get("embedding_scale", 1.0)),
            "residual_multiplier": float(m.get("residual_scale", 1.0)),
            "logits_scaling": float(m.get("logit_scale", 1.0)),
            **_granite_mamba(m, d),
            "num_local_experts": experts,
            "num_experts_per_tok": int(m.get("expert_used_count", 1)),
            "intermediate_size": int(m.get("feed_forward_length", 0)) if experts else 0,
            "shared_intermediate_size": int(m.get("expert_shared_feed_forward_length")
                                            or m.get("feed_forward_length", 0))}


def _granite_mamba(m: GGUFModel, d: int) -> dict[str, Any]:
    """The Mamba2, norm and attention-bias fields Granite-4.0-H's and Bamba's configs share
    (``mamba_*``)."""
    heads, inner = int(m.require("ssm.time_step_rank")), int(m.require("ssm.inner_size"))
    return {"rms_norm_eps": float(m.require("attention.layer_norm_rms_epsilon")),
            "mamba_n_heads": heads, "mamba_d_state": int(m.require("ssm.state_size")),
            "mamba_n_groups": int(m.require("ssm.group_count")),
            "mamba_d_conv": int(m.require("ssm.conv_kernel")),
            "mamba_expand": inner // d, "mamba_d_head": inner // heads,
            "mamba_conv_bias": any(k.endswith("ssm_conv1d.bias") for k in m.tensors),
            "mamba_proj_bias": any(k.endswith("ssm_in.bias") for k in m.tensors),
            "attention_bias": any(k.endswith("attn_q.bias") for k in m.tensors)}


def _bamba_config(m: GGUFModel) -> dict[str, Any]:
    c = _common(m, "bamba")
    n, d = c["num_hidden_layers"], c["hidden_size"]
    heads = int(m.require("attention.head_count"))
    attn = [i for i in range(n) if _has(m, i, "attn_q.weight")]
    return {**c,
            "attn_layer_indices": attn, "num_attention_heads": heads,
            "num_key_value_heads": _attention_kv(m, heads) if attn else heads,
            "head_dim": d // heads, "intermediate_size": int(m.require("feed_forward_length")),
            "rope_parameters": {
                "rope_theta": float(m.get("rope.freq_base", 10_000.0)),
                "partial_rotary_factor": int(m.get("rope.dimension_count", d // heads))
                / (d // heads)},
            **_granite_mamba(m, d),
            "mlp_bias": any(k.endswith("ffn_up.bias") for k in m.tensors)}


def _attention_kv(m: GGUFModel, heads: int) -> int:
    """Key-value heads from the first attention layer's k projection (a converter that
    did not see the layer types wrote no count)."""
    k = next(t for name, t in m.tensors.items() if name.endswith("attn_k.weight"))
    q = next(t for name, t in m.tensors.items() if name.endswith("attn_q.weight"))
    return heads * k.shape[0] // q.shape[0]


def _granite_merges(cfg: dict[str, Any]) -> tuple[Merge, ...]:
    """Granite's fused shared MLP and experts (Bamba's MLP is not fused)."""
    return _GRANITE_MERGES if cfg["model_type"] == "granitemoehybrid" else ()


_GRANITE_MERGES = (
    Merge(("blk.{n}.ffn_gate_shexp.weight", "blk.{n}.ffn_up_shexp.weight"),
          "model.layers.{n}.shared_mlp.input_linear.weight"),
    Merge(("blk.{n}.ffn_gate.weight", "blk.{n}.ffn_up.weight"),
          "model.layers.{n}.shared_mlp.input_linear.weight"),
    Merge(("blk.{n}.ffn_gate_exps.weight", "blk.{n}.ffn_up_exps.weight"),
          "model.layers.{n}.block_sparse_moe.input_linear.weight", dim=1),
)


# ---- Nemotron-H (nemotron_h, nemotron_h_moe) ---------------------------------------------


def _nemotron_config(m: GGUFModel) -> dict[str, Any]:
    c = _common(m, "nemotron_h")
    n = c["num_hidden_layers"]
    d = c["hidden_size"]
    heads = int(m.require("attention.head_count"))
    m_heads = int(m.require("ssm.time_step_rank"))
    types = ["full_attention" if _has(m, i, "attn_q.weight")
             else "moe" if _has(m, i, "ffn_gate_inp.weight")
             else "mlp" if _has(m, i, "ffn_up.weight") else "linear_attention"
             for i in range(n)]
    ff = [f for f in _per_layer(m.get("feed_forward_length", 0), n) if f]
    dense = next((t.shape[0] for k, t in m.tensors.items() if k.endswith(".ffn_up.weight")), 0)
    cfg = {**c, "tie_word_embeddings": False, "layers_block_type": types,
           "num_attention_heads": heads,
           "num_key_value_heads": _attention_kv(m, heads) if "full_attention" in types else 1,
           "head_dim": int(m.get("attention.key_length") or d // heads),
           "layer_norm_epsilon": float(m.require("attention.layer_norm_epsilon")),
           "mamba_num_heads": m_heads,
           "mamba_head_dim": int(m.require("ssm.inner_size")) // m_heads,
           "ssm_state_size": int(m.require("ssm.state_size")),
           "n_groups": int(m.require("ssm.group_count")),
           "conv_kernel": int(m.require("ssm.conv_kernel")),
           "use_conv_bias": any(k.endswith("ssm_conv1d.bias") for k in m.tensors),
           "use_bias": any(k.endswith("ssm_in.bias") for k in m.tensors),
           "mlp_bias": any(k.endswith("ffn_up.bias") for k in m.tensors),
           "attention_bias": any(k.endswith("attn_q.bias") for k in m.tensors),
           "intermediate_size": dense or (ff[0] if ff else 0)}
    if "moe" in types:
        cfg |= {"n_routed_experts": int(m.require("expert_count")),
                "num_experts_per_tok": int(m.require("expert_used_count")),
                "moe_intermediate_size": int(m.require("expert_feed_forward_length")),
                "moe_shared_expert_intermediate_size":
                    int(m.get("expert_shared_feed_forward_length", 0)),
                "n_group": int(m.get("expert_group_count", 1)),
                "topk_group": int(m.get("expert_group_used_count", 1)),
                "norm_topk_prob": bool(m.get("expert_weights_norm", True)),
                "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
                "moe_latent_size": _latent(m)}
    return cfg


def _latent(m: GGUFModel) -> int:
    """Nemotron-3's latent expert width (0: none), from its projection's shape."""
    t = next((t for k, t in m.tensors.items() if k.endswith("ffn_latent_down.weight")), None)
    return 0 if t is None else int(t.shape[0])


# ---- Falcon-H1 (falcon-h1) ---------------------------------------------------------------


def _falcon_h1_config(m: GGUFModel) -> dict[str, Any]:
    """Falcon-H1 with every µP multiplier 1: llama.cpp's converter multiplies them into the
    weights (each scales a projection's input or output, so the products are the same)."""
    c = _common(m, "falcon_h1")
    heads = int(m.require("attention.head_count"))
    m_heads = int(m.require("ssm.time_step_rank"))
    inner = int(m.require("ssm.inner_size"))
    return {**c,
            "intermediate_size": int(m.require("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
            "head_dim": int(m.get("attention.key_length") or c["hidden_size"] // heads),
            "rms_norm_eps": float(m.require("attention.layer_norm_rms_epsilon")),
            "rope_parameters": {"rope_theta": float(m.get("rope.freq_base", 1e11))},
            "mamba_d_ssm": inner, "mamba_n_heads": m_heads, "mamba_d_head": inner // m_heads,
            "mamba_d_state": int(m.require("ssm.state_size")),
            "mamba_n_groups": int(m.require("ssm.group_count")),
            "mamba_d_conv": int(m.require("ssm.conv_kernel")),
            "mamba_conv_bias": any(k.endswith("ssm_conv1d.bias") for k in m.tensors),
            "mamba_proj_bias": any(k.endswith("ssm_in.bias") for k in m.tensors),
            "mamba_rms_norm": any(k.endswith("ssm_norm.weight") for k in m.tensors),
            "attention_bias": any(k.endswith("attn_q.bias") for k in m.tensors),
            "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0] * 5,
            "key_multiplier": 1.0, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
            "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0,
            "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0}


# ---- Mamba, Falcon-Mamba (mamba) and Mamba2 (mamba2) --------------------------------------


def _mamba_config(m: GGUFModel) -> dict[str, Any]:
    """Mamba-1, or Falcon-Mamba (``ssm.dt_b_c_rms``: its weightless norms on dt, B and C,
    whose epsilon the file does not keep: the published models' 1e-6, transformers'
    default, not the layer norms' that llama.cpp applies there)."""
    falcon = bool(m.get("ssm.dt_b_c_rms", False))
    c = _common(m, "falcon_mamba" if falcon else "mamba")
    eps = float(m.require("attention.layer_norm_rms_epsilon"))
    return {**c, "intermediate_size": int(m.require("ssm.inner_size")),
            "state_size": int(m.require("ssm.state_size")),
            "time_step_rank": int(m.require("ssm.time_step_rank")),
            "conv_kernel": int(m.require("ssm.conv_kernel")),
            "use_conv_bias": any(k.endswith("ssm_conv1d.bias") for k in m.tensors),
            "use_bias": any(k.endswith("ssm_in.bias") for k in m.tensors),
            "layer_norm_epsilon": eps, **({"mixer_rms_eps": 1e-6} if falcon else {})}


def _mamba2_config(m: GGUFModel) -> dict[str, Any]:
    c = _common(m, "mamba2")
    heads = int(m.require("ssm.time_step_rank"))
    inner = int(m.require("ssm.inner_size"))
    return {**c, "num_heads": heads, "head_dim": inner // heads,
            "expand": inner // c["hidden_size"],
            "state_size": int(m.require("ssm.state_size")),
            "n_groups": int(m.require("ssm.group_count")),
            "conv_kernel": int(m.require("ssm.conv_kernel")),
            "use_conv_bias": any(k.endswith("ssm_conv1d.bias") for k in m.tensors),
            "use_bias": any(k.endswith("ssm_in.bias") for k in m.tensors),
            "layer_norm_epsilon": float(m.require("attention.layer_norm_rms_epsilon"))}


# ---- Jamba (jamba) -----------------------------------------------------------------------


def _jamba_config(m: GGUFModel) -> dict[str, Any]:
    c = _common(m, "jamba")
    n = c["num_hidden_layers"]
    d = c["hidden_size"]
    heads = int(m.require("attention.head_count"))
    attn = [i for i in range(n) if _has(m, i, "attn_q.weight")]
    moe = [i for i in range(n) if _has(m, i, "ffn_gate_inp.weight")]
    experts = int(m.get("expert_count", 1) or 1)
    return {**c,
            "intermediate_size": int(m.require("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": _attention_kv(m, heads) if attn else heads,
            "attn_layer_period": attn[1] - attn[0] if len(attn) > 1 else n,
            "attn_layer_offset": attn[0] if attn else n,
            "expert_layer_period": moe[1] - moe[0] if len(moe) > 1 else n,
            "expert_layer_offset": moe[0] if moe else 0,
            "num_experts": experts if moe else 1,
            "num_experts_per_tok": int(m.get("expert_used_count", 1)),
            "mamba_d_state": int(m.require("ssm.state_size")),
            "mamba_d_conv": int(m.require("ssm.conv_kernel")),
            "mamba_expand": int(m.require("ssm.inner_size")) // d,
            "mamba_dt_rank": int(m.require("ssm.time_step_rank")),
            "mamba_conv_bias": any(k.endswith("ssm_conv1d.bias") for k in m.tensors),
            "mamba_proj_bias": any(k.endswith("ssm_in.bias") for k in m.tensors),
            "rms_norm_eps": float(m.require("attention.layer_norm_rms_epsilon"))}



# ---- Kimi-Linear (kimi-linear) -----------------------------------------------------------


def _mla(m: GGUFModel) -> dict[str, Any]:
    """Multi-head latent attention's lengths (Kimi-Linear's and Ling's MLA layers)."""
    rope = int(m.require("rope.dimension_count"))
    return {"q_lora_rank": int(m.get("attention.q_lora_rank", 0) or 0) or None,
            "kv_lora_rank": int(m.require("attention.kv_lora_rank")),
            "qk_nope_head_dim": int(m.require("attention.key_length_mla")) - rope,
            "qk_rope_head_dim": rope,
            "v_head_dim": int(m.require("attention.value_length_mla"))}


def _kimi_config(m: GGUFModel) -> dict[str, Any]:
    """Kimi-Linear: KDA layers have no key-value heads (``attention.head_count_kv`` 0), the
    MLA layers' are the converter's one latent head; the KDA heads are the attention heads."""
    c = _common(m, "kimi_linear")
    n = c["num_hidden_layers"]
    heads = int(m.require("attention.head_count"))
    dense = int(m.get("leading_dense_block_count", 0) or 0)
    kv = _per_layer(m.require("attention.head_count_kv"), n)
    return {**c, "tie_word_embeddings": False,
            "layer_types": ["full_attention" if h else "linear_attention" for h in kv],
            "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)],
            "num_attention_heads": heads, "num_key_value_heads": heads,
            "intermediate_size": int(m.require("feed_forward_length")),
            "rms_norm_eps": float(m.require("attention.layer_norm_rms_epsilon")),
            **_mla(m),
            "linear_attn_config": {"num_heads": heads,
                                   "head_dim": int(m.require("kda.head_dim")),
                                   "short_conv_kernel_size": int(m.require("ssm.conv_kernel"))},
            "num_experts": int(m.require("expert_count")),
            "num_experts_per_token": int(m.require("expert_used_count")),
            "moe_intermediate_size": int(m.require("expert_feed_forward_length")),
            "num_shared_experts": int(m.get("expert_shared_count", 0) or 0),
            "n_group": int(m.get("expert_group_count", 1) or 1),
            "topk_group": int(m.get("expert_group_used_count", 1) or 1),
            "norm_topk_prob": bool(m.get("expert_weights_norm", True)),
            "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0))}


def _kv_b(parts: list[torch.Tensor], cfg: dict[str, Any]) -> torch.Tensor:
    """MLA's kv_b_proj ``[H (nope + v), R]`` from the converter's k_b ``[H, R, nope]``
    (transposed for the absorbed product) and v_b ``[H, v, R]``."""
    del cfg
    k_b, v_b = parts
    return torch.cat([k_b.transpose(1, 2), v_b], 1).reshape(-1, k_b.shape[1])


_KIMI_MERGES = (Merge(("blk.{n}.attn_k_b.weight", "blk.{n}.attn_v_b.weight"),
                      "model.layers.{n}.self_attn.kv_b_proj.weight", combine=_kv_b),)


# ---- Ling 3.0 hybrids (bailingmoe3) --------------------------------------------------------


def _ling_config(m: GGUFModel) -> dict[str, Any]:
    """Ling's hybrid (``BailingMoeV3ForCausalLM``; transformers' ``bailing_hybrid``): KDA
    layers have no key-value heads, MLA layers the converter's one latent head. The KDA
    heads are read off the first KDA layer's ``ssm_a`` (one decay a head); the converter
    writes no expert groups, so a file has one."""
    c = _common(m, "bailing_hybrid")
    n = c["num_hidden_layers"]
    kv = _per_layer(m.require("attention.head_count_kv"), n)
    types = ["full_attention" if h else "linear_attention" for h in kv[:n]]
    first_kda = types.index("linear_attention") if "linear_attention" in types else None
    kda_heads = int(m.tensors[f"blk.{first_kda}.ssm_a"].shape[0]) if first_kda is not None \
        else int(m.require("attention.head_count"))
    dense = int(m.get("leading_dense_block_count", 0) or 0)
    groups = int(m.get("expert_group_count", 1) or 1)
    moe = int(m.require("expert_feed_forward_length"))
    shared = int(m.get("expert_shared_feed_forward_length", 0) or 0)
    return {**c, "hidden_act": "silu", "tie_word_embeddings": False,
            "model_max_length": c["max_position_embeddings"],
            "layer_types": types,
            "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)],
            "intermediate_size": int(m.require("feed_forward_length")),
            "rms_norm_eps": float(m.require("attention.layer_norm_rms_epsilon")),
            "linear_num_heads": kda_heads, "linear_head_dim": int(m.require("kda.head_dim")),
            "linear_conv_kernel_dim": int(m.require("ssm.conv_kernel")),
            "kda_safe_gate": bool(m.get("kda.safe_gate", True)),
            "kda_lower_bound": float(m.get("kda.gate_lower_bound", -5.0)),
            "num_attention_heads": int(m.require("attention.head_count")),
            **_mla(m),
            "rope_parameters": {"rope_type": "default",
                                "rope_theta": float(m.require("rope.freq_base"))},
            "num_experts": int(m.require("expert_count")),
            "num_experts_per_token": int(m.require("expert_used_count")),
            "moe_intermediate_size": moe,
            "num_shared_experts": shared // moe if shared else
            int(m.get("expert_shared_count", 0) or 0),
            "num_expert_group": groups,
            "topk_group": int(m.get("expert_group_used_count", 1) or 1) if groups > 1 else 1,
            "moe_renormalize": bool(m.get("expert_weights_norm", True)),
            "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0))}


def _ling_transform(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """Ling's A_log, which the converter writes as exp(A_log) (Kimi's as −exp)."""
    del cfg
    return torch.log(t) if name.endswith("A_log") else t


_LING_ATTENTION = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                   "attn_output": "dense", "attn_q_a": "q_a_proj", "attn_q_b": "q_b_proj",
                   "attn_q_a_norm": "q_a_layernorm", "attn_kv_a_mqa": "kv_a_proj_with_mqa",
                   "attn_kv_a_norm": "kv_a_layernorm", "attn_gate": "g_proj",
                   "ssm_beta": "b_proj", "ssm_f_a": "f_proj", "ssm_g_a": "g_proj",
                   "ssm_conv1d_q": "q_conv1d", "ssm_conv1d_k": "k_conv1d",
                   "ssm_conv1d_v": "v_conv1d", "ssm_norm": "o_norm"}
_LING_MLP = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
             "ffn_gate_inp": "gate", "ffn_gate_shexp": "shared_experts.gate_proj",
             "ffn_up_shexp": "shared_experts.up_proj",
             "ffn_down_shexp": "shared_experts.down_proj"}
# gguf-py on PyPI has no bailingmoe3 tensor map: every name is given here, GGUF -> the
# checkpoint's (the family's rules take them on from there)
_LING_NAMES = (
    (r"token_embd\.weight", "model.word_embeddings.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    *((rf"blk\.(\d+)\.{g}\.weight", rf"model.layers.\1.attention.{h}.weight")
      for g, h in _LING_ATTENTION.items()),
    (r"blk\.(\d+)\.ssm_a", r"model.layers.\1.attention.A_log"),
    (r"blk\.(\d+)\.ssm_dt\.bias", r"model.layers.\1.attention.dt_bias"),
    *((rf"blk\.(\d+)\.{g}\.weight", rf"model.layers.\1.mlp.{h}.weight")
      for g, h in _LING_MLP.items()),
    (r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", r"model.layers.\1.mlp.experts.\2_proj"),
    (r"blk\.(\d+)\.exp_probs_b\.bias", r"model.layers.\1.mlp.gate.expert_bias"))
_LING_MERGES = (Merge(("blk.{n}.attn_k_b.weight", "blk.{n}.attn_v_b.weight"),
                      "model.layers.{n}.attention.kv_b_proj.weight", combine=_kv_b),)


def _rwkv7_config(m: GGUFModel) -> dict[str, Any]:
    """RWKV-7's sizes: the head, the four LoRA ranks, the channel mix's width. llama.cpp
    normalises the output groups with eps 64e-5 (BlinkDL's) whatever the head size."""
    return {**_common(m, "rwkv7"), "head_dim": int(m.require("wkv.head_size")),
            "norm_eps": float(m.get("attention.layer_norm_epsilon", 1e-5)),
            "decay_low_rank_dim": int(m.require("attention.decay_lora_rank")),
            "a_low_rank_dim": int(m.require("attention.iclr_lora_rank")),
            "v_low_rank_dim": int(m.require("attention.value_residual_mix_lora_rank")),
            "gate_low_rank_dim": int(m.require("attention.gate_lora_rank")),
            "intermediate_size": int(m.require("feed_forward_length")),
            "group_norm_eps": 64e-5}


def _rwkv6_config(m: GGUFModel) -> dict[str, Any]:
    """RWKV-6's sizes. The converter divides each layer's two output projections by
    2^(layer // rescale_every) and llama.cpp's graph halves the residual to match:
    ``rescaled_weights`` says the division is in the file."""
    return {**_common(m, "rwkv6"), "head_size": int(m.require("wkv.head_size")),
            "layer_norm_epsilon": float(m.get("attention.layer_norm_epsilon", 1e-5)),
            "rescale_every": int(m.get("rescale_every_n_layers", 0) or 0),
            "rescaled_weights": True,
            "time_mix_extra_dim": int(m.require("time_mix_extra_dim")),
            "time_decay_extra_dim": int(m.require("time_decay_extra_dim")),
            "intermediate_size": int(m.require("feed_forward_length"))}


def _rwkv6_transform(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """The converter's transposes undone: the two LoRAs' matrices back to ``x @ W``'s
    orientation, the token-shift LoRA's second ``[5, C, D]`` back to ``[5, D, C]``."""
    del cfg
    if re.search(r"\.(time_maa_w1|time_decay_w1|time_decay_w2)(\.weight)?$", name):
        return t.t()
    if re.search(r"\.time_maa_w2(\.weight)?$", name):
        return t.permute(0, 2, 1)
    return t


ARCHS: dict[str, GGUFArch] = {a.name: a for a in (
    GGUFArch("qwen35", _qwen35_config, _dt_bias, _qwen35_transform),
    GGUFArch("qwen35moe", _qwen35_config, _dt_bias, _qwen35_transform),
    GGUFArch("qwen3next", _qwen3next_config, _dt_bias, _qwen3next_transform,
             lambda cfg: _QWEN3NEXT_MERGES),
    GGUFArch("lfm2", _lfm2_config, transform=_lfm2_transform),
    GGUFArch("lfm2moe", _lfm2moe_config, transform=_lfm2_transform),
    GGUFArch("granitehybrid", _granite_config, _dt_bias, _granite_transform,
             _granite_merges),
    GGUFArch("nemotron_h", _nemotron_config, _dt_bias, _ssm_a),
    GGUFArch("nemotron_h_moe", _nemotron_config, _dt_bias, _ssm_a, names=(
        (r"blk\.(\d+)\.ffn_(up|down)_exps\.weight",
         r"backbone.layers.\1.mixer.experts.\2_proj"),
        (r"blk\.(\d+)\.exp_probs_b\.bias",
         r"backbone.layers.\1.mixer.gate.e_score_correction_bias"),
        (r"blk\.(\d+)\.ffn_latent_(up|down)\.weight",
         r"backbone.layers.\1.mixer.fc\2_latent_proj.weight"))),
    GGUFArch("jamba", _jamba_config, transform=_ssm_a),
    GGUFArch("falcon-h1", _falcon_h1_config, _dt_bias, _ssm_a),
    GGUFArch("mamba", _mamba_config, transform=_ssm_a),
    GGUFArch("mamba2", _mamba2_config, _dt_bias, _ssm_a),
    GGUFArch("kimi-linear", _kimi_config, _dt_bias, _ssm_a, lambda cfg: _KIMI_MERGES, names=(
        (r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", r"model.layers.\1.mlp.experts.\2_proj"),
        (r"blk\.(\d+)\.exp_probs_b\.bias", r"model.layers.\1.mlp.gate.e_score_correction_bias"))),
    GGUFArch("bailingmoe3", _ling_config, transform=_ling_transform,
             merges=lambda cfg: _LING_MERGES, names=_LING_NAMES),
    # the converter stacks the six token-shift lerps into one tensor (the family splits it)
    GGUFArch("rwkv7", _rwkv7_config, names=(
        (r"blk\.(\d+)\.time_mix_lerp_fused\.weight", r"model.layers.\1.attn.x_fused"),)),
    # RWKV-6's five data-dependent lerps (w, k, v, r, g) stacked the same way
    GGUFArch("rwkv6", _rwkv6_config, transform=_rwkv6_transform, names=(
        (r"blk\.(\d+)\.time_mix_lerp_fused\.weight",
         r"rwkv.blocks.\1.attention.time_maa_fused"),)),
)}


def arch_of(model: GGUFModel) -> GGUFArch:
    """The served architecture of ``model``; KeyError naming it when not served."""
    if model.arch not in ARCHS:
        raise KeyError(f"architecture {model.arch!r} is not served from GGUF files (these "
                       f"are: {', '.join(sorted(ARCHS))})")
    return ARCHS[model.arch]
