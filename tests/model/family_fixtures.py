"""Tiny random checkpoints of the Hugging Face families made at test time with
``transformers`` (the reference) and saved with ``save_pretrained``, with the project's
8,192-token tokenizer. Two or more shapes a family: layer patterns, GQA ratios, head sizes,
tied and untied heads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model.qwen_fixtures import SHAPES as QWEN_SHAPES
from tests.model.qwen_fixtures import text_config as qwen_text_config
from tests.paths import ROOT

TOKENIZER = ROOT / "weights" / "tokenizer.json"
VOCAB = 8192


def _lfm2(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    cfg = t.Lfm2Config(vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
                       num_hidden_layers=len(shape["types"]), layer_types=shape["types"],
                       num_attention_heads=shape["heads"][0],
                       num_key_value_heads=shape["heads"][1],
                       max_position_embeddings=4096, tie_word_embeddings=shape["tie"],
                       conv_L_cache=shape.get("L", 3), block_multiple_of=32,
                       block_ffn_dim_multiplier=shape.get("mult", 1.0))
    return t.Lfm2ForCausalLM(cfg)


def _lfm2_moe(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    experts, top_k = shape["experts"]
    cfg = t.Lfm2MoeConfig(vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
                          moe_intermediate_size=shape["moe"],
                          num_hidden_layers=len(shape["types"]), layer_types=shape["types"],
                          num_attention_heads=shape["heads"][0],
                          num_key_value_heads=shape["heads"][1],
                          max_position_embeddings=4096, tie_word_embeddings=shape["tie"],
                          num_dense_layers=shape["dense"], num_experts=experts,
                          num_experts_per_tok=top_k, use_expert_bias=shape["bias"],
                          norm_topk_prob=shape.get("norm", True),
                          routed_scaling_factor=shape.get("scaling", 1.0))
    return t.Lfm2MoeForCausalLM(cfg)


def qwen_moe_fields(shape: dict[str, Any]) -> dict[str, Any]:
    """The fields Qwen3.5-MoE's and Qwen3-Next's configs share."""
    kq, kv, dk, dv = shape["linear"]
    n = len(shape["types"])
    experts, top_k = shape["experts"]
    return {"vocab_size": VOCAB, "hidden_size": shape["d"], "num_hidden_layers": n,
            "layer_types": shape["types"], "num_attention_heads": shape["heads"][0],
            "num_key_value_heads": shape["heads"][1], "head_dim": shape["head_dim"],
            "linear_num_key_heads": kq, "linear_num_value_heads": kv,
            "linear_key_head_dim": dk, "linear_value_head_dim": dv,
            "max_position_embeddings": 4096, "tie_word_embeddings": shape["tie"],
            "num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": shape["moe"],
            "shared_expert_intermediate_size": shape["shared"]}


def _qwen3_5(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    return t.Qwen3_5ForCausalLM(qwen_text_config(shape, VOCAB))


def _qwen3_5_moe(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    return t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(**qwen_moe_fields(shape)))


def _qwen3_next(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    return t.Qwen3NextForCausalLM(t.Qwen3NextConfig(
        **qwen_moe_fields(shape), intermediate_size=shape["ff"],
        decoder_sparse_step=shape.get("step", 1), mlp_only_layers=shape.get("dense", []),
        norm_topk_prob=shape.get("norm", True)))


def _granite(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    d = shape["d"]
    experts, top_k = shape.get("experts", (0, 1))
    cfg = t.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=shape.get("moe", 2 * d),
        shared_intermediate_size=shape["ff"], num_hidden_layers=len(shape["types"]),
        layer_types=shape["types"], num_attention_heads=shape["heads"][0],
        num_key_value_heads=shape["heads"][1], max_position_embeddings=4096,
        tie_word_embeddings=shape["tie"], num_local_experts=experts,
        num_experts_per_tok=top_k,
        position_embedding_type=shape.get("pos"), mamba_n_heads=shape["mamba"][0],
        mamba_d_state=shape["mamba"][1], mamba_n_groups=shape["mamba"][2], mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=32, embedding_multiplier=shape.get("emb", 1.0),
        residual_multiplier=shape.get("res", 1.0), logits_scaling=shape.get("logits", 1.0),
        attention_multiplier=shape.get("attn", (d // shape["heads"][0]) ** -0.5))
    return t.GraniteMoeHybridForCausalLM(cfg)


def _nemotron(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    cfg = t.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=shape["d"], layers_block_type=shape["types"],
        num_hidden_layers=len(shape["types"]), num_attention_heads=shape["heads"][0],
        num_key_value_heads=shape["heads"][1], head_dim=shape["head_dim"],
        intermediate_size=shape["ff"], mamba_num_heads=shape["mamba"][0],
        mamba_head_dim=shape["mamba"][1], ssm_state_size=shape["mamba"][2],
        n_groups=shape["mamba"][3], conv_kernel=4, chunk_size=32,
        time_step_min=shape.get("dt_min", 0.001), max_position_embeddings=4096,
        tie_word_embeddings=shape["tie"], **_nemotron_moe(shape))
    return t.NemotronHForCausalLM(cfg)


def _nemotron_moe(shape: dict[str, Any]) -> dict[str, Any]:
    """A Nemotron-H shape's MoE fields (none: no experts)."""
    if "experts" not in shape:
        return {"n_routed_experts": 0}
    (experts, top_k), (groups, topk_groups) = shape["experts"], shape["groups"]
    return {"n_routed_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": shape["moe"],
            "moe_shared_expert_intermediate_size": shape["shared"],
            "moe_latent_size": shape.get("latent"), "n_group": groups,
            "topk_group": topk_groups, "norm_topk_prob": shape.get("norm", True),
            "routed_scaling_factor": shape.get("scaling", 1.0)}


def _falcon(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    d = shape["d"]
    cfg = t.FalconH1Config(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=shape["ff"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"][0],
        num_key_value_heads=shape["heads"][1], max_position_embeddings=4096,
        tie_word_embeddings=shape["tie"], mamba_d_ssm=shape["mamba"][0],
        mamba_n_heads=shape["mamba"][1], mamba_d_state=shape["mamba"][2],
        mamba_n_groups=shape["mamba"][3], mamba_d_conv=4, mamba_chunk_size=32,
        mamba_rms_norm=shape["rms"], mamba_norm_before_gate=shape.get("before", True),
        **shape.get("mult", {}))
    return t.FalconH1ForCausalLM(cfg)


def _mamba(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    falcon = shape.get("falcon", False)
    cls, config = ((t.FalconMambaForCausalLM, t.FalconMambaConfig) if falcon
                   else (t.MambaForCausalLM, t.MambaConfig))
    cfg = config(vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["inner"],
                 num_hidden_layers=shape["layers"], state_size=shape["state"],
                 time_step_rank=shape["rank"], conv_kernel=shape.get("conv", 4),
                 use_conv_bias=shape.get("conv_bias", True), tie_word_embeddings=shape["tie"],
                 **({"mixer_rms_eps": 1e-6} if falcon else {}))
    return cls(cfg)


def _mamba2(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    heads, head_dim, state, groups = shape["mamba"]
    cfg = t.Mamba2Config(vocab_size=VOCAB, hidden_size=shape["d"], num_heads=heads,
                         head_dim=head_dim, expand=heads * head_dim // shape["d"],
                         state_size=state, n_groups=groups, num_hidden_layers=shape["layers"],
                         conv_kernel=4, chunk_size=32, tie_word_embeddings=shape["tie"])
    return t.Mamba2ForCausalLM(cfg)


def _bamba(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    heads, d_state, groups = shape["mamba"]
    cfg = t.BambaConfig(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"][0],
        num_key_value_heads=shape["heads"][1], attn_layer_indices=shape["attn"],
        mamba_n_heads=heads, mamba_d_state=d_state, mamba_n_groups=groups, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=32, max_position_embeddings=4096,
        tie_word_embeddings=shape["tie"],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                         "partial_rotary_factor": shape.get("rotary", 1.0)})
    return t.BambaForCausalLM(cfg)


def _jamba(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    experts, top_k = shape.get("experts", (1, 1))
    cfg = t.JambaConfig(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"][0],
        num_key_value_heads=shape["heads"][1], attn_layer_period=shape["attn"][0],
        attn_layer_offset=shape["attn"][1], expert_layer_period=2, expert_layer_offset=1,
        num_experts=experts, num_experts_per_tok=top_k, mamba_d_state=shape["state"],
        mamba_dt_rank=shape["rank"], mamba_expand=2, mamba_d_conv=4,
        max_position_embeddings=4096, tie_word_embeddings=shape["tie"])
    return t.JambaForCausalLM(cfg)


def _zamba2(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    heads, kv_heads = shape["heads"]
    cfg = t.Zamba2Config(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        num_hidden_layers=len(shape["types"]), layers_block_type=shape["types"],
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        n_mamba_heads=shape["mamba"][0], mamba_d_state=shape["mamba"][1],
        mamba_ngroups=shape["mamba"][2], mamba_expand=2, mamba_d_conv=4, chunk_size=32,
        num_mem_blocks=shape["blocks"], use_shared_attention_adapter=shape["adapters"],
        adapter_rank=shape["rank"], use_mem_rope=shape["rope"], max_position_embeddings=4096,
        tie_word_embeddings=shape["tie"], time_step_min=1e-9)  # the limit never binds
    return t.Zamba2ForCausalLM(cfg)


def _recurrent_gemma(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    heads, kv_heads = shape["heads"]
    cfg = t.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        num_hidden_layers=shape["layers"], num_attention_heads=heads,
        num_key_value_heads=kv_heads, lru_width=shape.get("lru"),
        attention_window_size=shape["window"], block_types=shape["types"],
        logits_soft_cap=shape.get("cap", 30.0), tie_word_embeddings=True)
    return t.RecurrentGemmaForCausalLM(cfg)


def _lfm3(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    heads, kv_heads = shape["heads"]
    cfg = t.Lfm3Config(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        num_hidden_layers=len(shape["types"]), layer_types=shape["types"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=shape["head_dim"],
        sliding_window=shape["window"], conv_L_cache=shape["L"],
        use_sandwich_norm=shape["sandwich"], use_attention_gate=shape["gate"],
        tie_word_embeddings=shape["tie"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return t.Lfm3ForCausalLM(cfg)


def _olmo_hybrid(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    heads, kv_heads = shape["heads"]
    kh, vh, dk, dv = shape["linear"]
    rope = {"rope_type": "default", "rope_theta": 10_000.0} if shape["rope"] else None
    cfg = t.OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        num_hidden_layers=len(shape["types"]), layer_types=shape["types"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, linear_num_key_heads=kh,
        linear_num_value_heads=vh, linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_allow_neg_eigval=shape["neg"], rope_parameters=rope,
        max_position_embeddings=4096, tie_word_embeddings=shape["tie"], pad_token_id=0,
        eos_token_id=2)
    return t.OlmoHybridForCausalLM(cfg)


def _minimax(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    heads, kv_heads = shape["heads"]
    experts, top_k = shape["experts"]
    cfg = t.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        num_hidden_layers=len(shape["types"]), layer_types=shape["types"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=shape["head_dim"],
        num_local_experts=experts, num_experts_per_tok=top_k, block_size=shape["block"],
        max_position_embeddings=4096, tie_word_embeddings=shape["tie"],
        **shape.get("factors", {}))
    return t.MiniMaxForCausalLM(cfg)


def _kimi_linear(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    experts, top_k, groups, top_groups = shape["experts"]
    n = len(shape["types"])
    cfg = t.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        moe_intermediate_size=shape["moe"], num_hidden_layers=n, layer_types=shape["types"],
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1), num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"], q_lora_rank=shape.get("q_lora"),
        kv_lora_rank=shape["kv_lora"], qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, linear_num_heads=shape["linear"][0], linear_head_dim=shape["linear"][1],
        num_local_experts=experts, num_experts_per_tok=top_k, n_group=groups,
        topk_group=top_groups, routed_scaling_factor=shape.get("scaling", 1.0),
        max_position_embeddings=4096, tie_word_embeddings=shape["tie"], pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    return t.KimiLinearForCausalLM(cfg)


def _bailing_hybrid(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    experts, top_k, groups, top_groups = shape["experts"]
    cfg = t.BailingHybridConfig(
        vocab_size=VOCAB, hidden_size=shape["d"], intermediate_size=shape["ff"],
        moe_intermediate_size=shape["moe"], num_hidden_layers=shape["layers"],
        layer_group_size=shape["group"], first_k_dense_replace=1,
        num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
        q_lora_rank=None, kv_lora_rank=shape["kv_lora"], qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=shape["linear"][0],
        linear_head_dim=shape["linear"][1], num_experts=experts, n_routed_experts=experts,
        num_experts_per_token=top_k, num_expert_group=groups, topk_group=top_groups,
        kda_safe_gate=shape["safe"], routed_scaling_factor=2.5, model_max_length=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return t.BailingHybridForCausalLM(cfg)


def _xlstm(shape: dict[str, Any]) -> Any:
    t = pytest.importorskip("transformers")
    cfg = t.xLSTMConfig(vocab_size=VOCAB, hidden_size=shape["d"], num_hidden_layers=shape["layers"],
                        num_heads=shape["heads"], qk_dim_factor=shape.get("qk", 0.5),
                        v_dim_factor=shape.get("v", 1.0), ffn_proj_factor=shape.get("ffn", 2.667),
                        tie_word_embeddings=shape["tie"], chunk_size=shape.get("chunk", 64),
                        autocast_kernel_dtype="float32", inference_state_dtype="float32",
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return t.xLSTMForCausalLM(cfg)


# family -> shape name -> shape
SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3_5": QWEN_SHAPES,  # interval: a full-attention layer every `interval` layers
    "lfm2": {
        "a2-tied": {"d": 64, "ff": 192, "heads": (4, 2), "tie": True,
                    "types": ["conv", "conv", "full_attention", "conv", "full_attention"]},
        "a1-untied": {"d": 96, "ff": 256, "heads": (6, 1), "tie": False, "L": 4, "mult": 1.5,
                      "types": ["full_attention", "conv", "conv", "conv"]},
    },
    "lfm2_moe": {  # experts: (experts, top k)
        "e6k2-tied": {"d": 64, "ff": 128, "moe": 48, "heads": (4, 2), "tie": True,
                      "experts": (6, 2), "dense": 1, "bias": True,
                      "types": ["conv", "full_attention", "conv", "conv"]},
        "e9k3-untied": {"d": 48, "ff": 96, "moe": 32, "heads": (3, 1), "tie": False,
                        "experts": (9, 3), "dense": 2, "bias": False, "norm": False,
                        "scaling": 1.5,
                        "types": ["full_attention", "conv", "conv", "conv", "full_attention"]},
    },
    # linear: (key heads, value heads, key dim, value dim); shared: the shared expert's size
    "qwen3_5_moe": {
        "e8k2-tied": {"d": 64, "heads": (4, 2), "head_dim": 32, "linear": (2, 4, 16, 16),
                      "tie": True, "experts": (8, 2), "moe": 32, "shared": 48,
                      "types": ["linear_attention", "linear_attention", "full_attention"]},
        "e5k3-untied": {"d": 48, "heads": (4, 1), "head_dim": 16, "linear": (1, 3, 24, 16),
                        "tie": False, "experts": (5, 3), "moe": 40, "shared": 24,
                        "types": ["linear_attention", "full_attention", "linear_attention",
                                  "full_attention"]},
    },
    "qwen3_next": {
        "e6k2-step2": {"d": 64, "ff": 96, "heads": (4, 2), "head_dim": 32,
                       "linear": (2, 4, 16, 24), "tie": False, "experts": (6, 2), "moe": 32,
                       "shared": 40, "step": 2, "dense": [3],
                       "types": ["linear_attention", "linear_attention", "linear_attention",
                                 "full_attention"]},
        "e9k3-nonorm": {"d": 48, "ff": 64, "heads": (6, 3), "head_dim": 16,
                        "linear": (3, 3, 16, 16), "tie": True, "experts": (9, 3), "moe": 24,
                        "shared": 32, "norm": False,
                        "types": ["full_attention", "linear_attention", "linear_attention"]},
    },
    "granitemoehybrid": {  # mamba: (heads, d_state, groups)
        "rope-g2": {"d": 64, "ff": 96, "heads": (4, 2), "tie": True, "pos": "rope",
                    "mamba": (8, 16, 2), "emb": 2.0, "res": 0.5, "logits": 2.0, "attn": 0.2,
                    "types": ["linear_attention", "linear_attention", "attention",
                              "linear_attention"]},
        "nope-g1": {"d": 48, "ff": 80, "heads": (3, 1), "tie": False, "pos": None,
                    "mamba": (4, 24, 1),  # d_state 24: the step's 16 lanes and a tail
                    "types": ["attention", "linear_attention", "linear_attention"]},
        "moe-e5k2": {"d": 64, "ff": 64, "moe": 48, "heads": (4, 2), "tie": True, "pos": "rope",
                     "mamba": (8, 16, 2), "experts": (5, 2), "res": 0.5,
                     "types": ["linear_attention", "attention", "linear_attention"]},
        "moe-e8k3": {"d": 48, "ff": 80, "moe": 40, "heads": (3, 3), "tie": False, "pos": None,
                     "mamba": (4, 8, 1), "experts": (8, 3),
                     "types": ["attention", "linear_attention"]},
    },
    "nemotron_h": {  # mamba: (heads, head_dim, d_state, groups)
        "a-g2": {"d": 64, "ff": 128, "heads": (4, 2), "head_dim": 16, "tie": False,
                 "mamba": (8, 16, 16, 2), "dt_min": 1e-9,
                 "types": ["linear_attention", "mlp", "full_attention", "mlp",
                           "linear_attention", "mlp"]},
        "b-g1": {"d": 48, "ff": 96, "heads": (6, 3), "head_dim": 32, "tie": True,
                 "mamba": (4, 24, 8, 1),
                 "types": ["full_attention", "linear_attention", "mlp", "linear_attention"]},
        # experts: (experts, top k); groups: (n_group, topk_group)
        "moe-e8k2-g4": {"d": 64, "ff": 96, "heads": (4, 2), "head_dim": 16, "tie": False,
                        "mamba": (8, 16, 16, 2), "experts": (8, 2), "groups": (4, 2),
                        "moe": 32, "shared": 48,
                        "types": ["linear_attention", "moe", "full_attention", "moe"]},
        "moe-e6k3-latent": {"d": 48, "ff": 64, "heads": (3, 1), "head_dim": 16, "tie": False,
                            "mamba": (4, 24, 8, 1), "experts": (6, 3), "groups": (1, 1),
                            "moe": 24, "shared": 40, "latent": 32, "norm": False,
                            "scaling": 2.5,
                            "types": ["moe", "linear_attention", "full_attention", "mlp"]},
    },
    "mamba": {  # Mamba-1: inner width, d_state, dt rank; falcon: Falcon-Mamba's norms
        # scale: its logits' fp32 rounding (transformers' own is 9e-5 from fp64 at 3x) under
        # the tests' 1e-4
        "tied-r4": {"d": 32, "inner": 64, "state": 8, "rank": 4, "layers": 3, "tie": True,
                    "scale": 2.0},
        "falcon-untied": {"d": 48, "inner": 96, "state": 16, "rank": 3, "layers": 2,
                          "tie": False, "falcon": True, "conv": 3, "conv_bias": False,
                          "scale": 2.0},
    },
    "mamba2": {  # mamba: (heads, head_dim, d_state, groups)
        "g2-untied": {"d": 32, "mamba": (8, 8, 16, 2), "layers": 3, "tie": False},
        "g1-tied": {"d": 48, "mamba": (6, 16, 24, 1), "layers": 2, "tie": True},
    },
    "bamba": {  # mamba: (heads, d_state, groups); attn: attn_layer_indices
        "half-rope-g2": {"d": 64, "ff": 96, "heads": (4, 2), "layers": 4, "attn": [1, 3],
                         "mamba": (8, 16, 2), "tie": False, "rotary": 0.5},
        "full-rope-g1": {"d": 48, "ff": 80, "heads": (3, 1), "layers": 3, "attn": [0],
                         "mamba": (4, 8, 1), "tie": True},
    },
    "jamba": {  # attn: (attn_layer_period, attn_layer_offset); experts every second layer
        "moe-e4k2": {"d": 32, "ff": 64, "heads": (4, 2), "layers": 4, "attn": (2, 1),
                     "state": 8, "rank": 4, "experts": (4, 2), "tie": False, "scale": 2.0},
        "dense-tied": {"d": 48, "ff": 80, "heads": (3, 1), "layers": 3, "attn": (3, 0),
                       "state": 16, "rank": 3, "tie": True, "scale": 2.0},
    },
    "lfm3": {  # window: the sliding layers', smaller than the tests' prompts
        "w16-gate-sandwich": {"d": 64, "ff": 96, "heads": (4, 2), "head_dim": 16, "window": 16,
                              "L": 7, "sandwich": True, "gate": True, "tie": True,
                              "types": ["conv", "sliding_attention", "full_attention",
                                        "conv", "sliding_attention"]},
        "w24-plain": {"d": 48, "ff": 80, "heads": (6, 3), "head_dim": 16, "window": 24,
                      "L": 3, "sandwich": False, "gate": False, "tie": False,
                      "types": ["sliding_attention", "conv", "full_attention"]},
    },
    # linear: (key heads, value heads, key dim, value dim), as many key channels as value
    # ones: transformers saves the q, k and v conv kernels as equal thirds of the whole (its
    # published layout has each at its own width, which loads; a third each does not)
    "olmo_hybrid": {  # neg: β in (0, 2)
        "rope-neg": {"d": 64, "ff": 96, "heads": (4, 2), "linear": (2, 4, 16, 8),
                     "neg": True, "rope": True, "tie": False,
                     "types": ["linear_attention", "linear_attention", "full_attention"]},
        "nope-pos": {"d": 48, "ff": 80, "heads": (3, 3), "linear": (3, 3, 16, 16),
                     "neg": False, "rope": False, "tie": True,
                     "types": ["full_attention", "linear_attention", "linear_attention",
                               "full_attention"]},
        # value_dim 144 != key_dim 48: transformers saves the conv kernels as equal thirds
        "wide-v": {"d": 64, "ff": 96, "heads": (4, 2), "linear": (3, 3, 16, 48),
                   "neg": True, "rope": True, "tie": False,
                   "types": ["linear_attention", "full_attention"]},
    },
    "minimax": {  # block: the lightning prefill's block, not dividing the tests' prompts
        "b24-factors": {"d": 64, "ff": 48, "heads": (4, 2), "head_dim": 16, "experts": (4, 2),
                        "block": 24, "tie": False,
                        "types": ["linear_attention", "full_attention", "linear_attention"],
                        "factors": {"linear_attn_alpha_factor": 1.5,
                                    "linear_attn_beta_factor": 0.75,
                                    "full_attn_alpha_factor": 0.9,
                                    "full_attn_beta_factor": 1.2, "mlp_alpha_factor": 1.1,
                                    "mlp_beta_factor": 0.8}},
        "b16-tied": {"d": 48, "ff": 32, "heads": (3, 1), "head_dim": 16, "experts": (6, 3),
                     "block": 16, "tie": True,
                     "types": ["full_attention", "linear_attention", "linear_attention",
                               "full_attention"]},
    },
    "kimi_linear": {  # experts: (experts, top k, groups, groups chosen); linear: KDA heads
        "qlora-groups": {"d": 64, "ff": 96, "moe": 32, "heads": 4, "q_lora": 24,
                         "kv_lora": 32, "linear": (4, 16), "experts": (8, 2, 4, 2),
                         "scaling": 2.5, "tie": False,
                         "types": ["linear_attention", "full_attention", "linear_attention"]},
        "plain-q": {"d": 48, "ff": 64, "moe": 24, "heads": 3, "kv_lora": 16,
                    "linear": (3, 16), "experts": (6, 3, 1, 1), "tie": True,
                    "types": ["full_attention", "linear_attention", "linear_attention",
                              "full_attention"]},
    },
    "bailing_hybrid": {  # group: layer_group_size (its last layer MLA); safe: kda_safe_gate
        "safe-g3": {"d": 64, "ff": 96, "moe": 32, "heads": 4, "kv_lora": 32, "layers": 3,
                    "group": 3, "linear": (4, 16), "experts": (8, 2, 4, 2), "safe": True},
        # one expert group, as llama.cpp's converter writes Ling (it writes no groups)
        "safe-g2-one-group": {"d": 64, "ff": 96, "moe": 32, "heads": 4, "kv_lora": 32,
                              "layers": 4, "group": 2, "linear": (4, 16),
                              "experts": (8, 2, 1, 1), "safe": True},
        "softplus-g2": {"d": 48, "ff": 64, "moe": 24, "heads": 3, "kv_lora": 16, "layers": 4,
                        "group": 2, "linear": (3, 16), "experts": (6, 3, 1, 1),
                        "safe": False},
    },
    "zamba2": {  # mamba: (heads, d_state, groups); blocks: shared blocks used in turn
        "two-blocks-adapters": {"d": 32, "ff": 48, "heads": (4, 4), "mamba": (4, 16, 1),
                                "blocks": 2, "adapters": True, "rank": 8, "rope": True,
                                "tie": True, "types": ["mamba", "hybrid", "mamba", "hybrid",
                                                       "hybrid", "mamba"]},
        "gqa-one-block": {"d": 48, "ff": 64, "heads": (6, 2), "mamba": (6, 8, 2),
                          "blocks": 1, "adapters": False, "rank": 4, "rope": False,
                          "tie": False, "types": ["hybrid", "mamba", "mamba", "hybrid"]},
    },
    "recurrent_gemma": {  # window: the local attention's, smaller than the tests' prompts
        "w16-gqa": {"d": 32, "ff": 96, "heads": (4, 1), "layers": 4, "window": 16,
                    "types": ["recurrent", "recurrent", "attention"], "cap": 3.0},
        "w24-lru48": {"d": 48, "ff": 128, "heads": (6, 6), "layers": 3, "window": 24,
                      "lru": 48, "types": ["attention", "recurrent"]},
    },
    "falcon_h1": {  # mamba: (d_ssm, heads, d_state, groups)
        "norm-g2": {"d": 64, "ff": 96, "layers": 3, "heads": (4, 2), "tie": False,
                    "mamba": (96, 6, 16, 2), "rms": True, "mult": {
                        "embedding_multiplier": 1.5, "lm_head_multiplier": 0.5,
                        "attention_in_multiplier": 0.8, "attention_out_multiplier": 1.2,
                        "key_multiplier": 0.7, "ssm_in_multiplier": 1.1,
                        "ssm_out_multiplier": 0.9, "mlp_multipliers": [1.3, 0.6],
                        "ssm_multipliers": [0.9, 1.1, 1.2, 0.8, 1.05]}},
        "gate-g1": {"d": 48, "ff": 80, "layers": 2, "heads": (6, 1), "tie": True,
                    "mamba": (64, 4, 8, 1), "rms": False},
    },
    # transformers' xLSTM-7B layout (mLSTM blocks); d·qk and d·v multiples of 64, as its
    # cache sizes them; chunk: its chunkwise kernel's
    "xlstm": {
        "h4-untied": {"d": 128, "layers": 2, "heads": 4, "tie": False, "chunk": 32},
        "h2-v2": {"d": 64, "layers": 3, "heads": 2, "tie": False, "v": 2.0, "qk": 1.0,
                  "ffn": 2.0},
    },
}
BUILDERS = {"qwen3_5": _qwen3_5, "lfm2": _lfm2, "lfm2_moe": _lfm2_moe, "qwen3_5_moe": _qwen3_5_moe,
            "qwen3_next": _qwen3_next, "granitemoehybrid": _granite,
            "nemotron_h": _nemotron, "falcon_h1": _falcon, "mamba": _mamba, "mamba2": _mamba2,
            "bamba": _bamba, "jamba": _jamba,
            "zamba2": _zamba2, "recurrent_gemma": _recurrent_gemma, "lfm3": _lfm3,
            "olmo_hybrid": _olmo_hybrid, "minimax": _minimax, "kimi_linear": _kimi_linear,
            "bailing_hybrid": _bailing_hybrid, "xlstm": _xlstm}
CASES = [(family, name) for family, shapes in SHAPES.items() for name in sorted(shapes)]


def make(path: Path, family: str, name: str, seed: int = 0, scale: float = 3.0) -> Path:
    """Save a random-weight checkpoint of ``SHAPES[family][name]``, its matrices ``scale``
    (or the shape's own) times transformers' initialisation (so layers matter; Mamba-1's
    ``[inner, N]`` A_log, the log of its decay rates, stays as initialised), with the
    project's tokenizer."""
    torch.manual_seed(seed)
    model = BUILDERS[family](SHAPES[family][name])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # matrices; Mamba-1's A_log is a decay
            p.mul_(SHAPES[family][name].get("scale", scale)
                   if p.dim() > 1 and not pname.endswith("A_log") else 1.0)
        for name, b in model.named_buffers():
            if name.endswith(("expert_bias", "correction_bias")):  # zero at init: choose
                b.copy_(torch.rand(b.shape, generator=gen) - 0.5)
    model.eval().save_pretrained(path)
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return path


def reference(path: Path) -> Any:
    """The checkpoint loaded by transformers, fp32, eval."""
    t = pytest.importorskip("transformers")
    return t.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
