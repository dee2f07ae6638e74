"""``python -m bench.families``: the constant-state families against llama.cpp on the same
weights (never run by CI; ``bash bench/llamacpp.sh build`` first).

Checkpoints of published shapes with random weights, made with transformers (``--make``):

- ``lfm2-1.2b``: LFM2-1.2B (hidden 2048, 16 layers of which 6 attention, SwiGLU of 8192,
  vocabulary 65,536, tied): 1.17B parameters;
- ``granite-4.0-h-micro``: Granite-4.0-H-Micro (hidden 2048, 40 layers: 36 Mamba2 of 64
  heads x 64 with a state of 128, 4 attention without RoPE; a shared SwiGLU of 8192;
  vocabulary 100,352, tied): 3.2B parameters;
- ``lfm2-8b-a1b``: LFM2-8B-A1B (hidden 2048, 24 layers of which 6 attention, 2 dense
  layers, 32 experts of 1792, top 4, vocabulary 65,536): 8.3B parameters, about 1.5B read a
  token;
- ``qwen3.5-35b-a3b-8l``: Qwen3.5-35B-A3B's shapes with its first 8 of 40 layers (256
  experts of 512, top 8, a shared expert, vocabulary 248,320): in bf16 the whole model
  does not fit this disk;
- ``falcon-mamba-7b-8l``, ``mamba-codestral-7b-8l``: Falcon-Mamba-7B (Mamba-1, hidden 4096,
  inner 8192, d_state 16) and Mamba-Codestral-7B (Mamba2, 128 heads x 64, d_state 128,
  8 groups) with their first 8 of 64 layers;
- ``jamba-8l-e4``: Jamba-v0.1's layers, 8 of them (attention at the fifth), with 4 of its
  16 experts.

For each weight type (bf16, int8 against Q8_0, int4 against Q4_0) both servers are up at
once (:func:`bench.memory.one_kind`: this server as a user starts it, ``llama-server -t 2
--parallel 16``) and measured alternately with the same client: one stream alone, then
(``--prefill``) a prompt of about 2,048 tokens, then 16 concurrent streams; their resident
memory too. The batch-1 figure is also set against the read roofline: the bytes a token
reads (every weight outside the experts, plus the chosen experts of each MoE layer, as
packed) times tokens/s, over one core's measured read bandwidth times the threads.

Writes ``bench/results/families.json`` (each model's entry kept until it is run again) and
``families.png`` (decode tokens/s against active parameters).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from bench import memory
from bench.common import machine, save_figure, saved_models, write_json
from bench.roofline import read_bandwidth_gbs

LFM2_8B_A1B: dict[str, Any] = {
    "model_type": "lfm2_moe", "vocab_size": 65536, "hidden_size": 2048,
    "intermediate_size": 7168, "moe_intermediate_size": 1792, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_dense_layers": 2,
    "num_experts": 32, "num_experts_per_tok": 4, "use_expert_bias": True,
    "norm_topk_prob": True, "tie_word_embeddings": True, "max_position_embeddings": 128000,
    "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv"
                    for i in range(24)]}
QWEN35_35B_A3B_8L: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                    for i in range(8)]}
LFM2_1_2B: dict[str, Any] = {
    "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 12288,
    "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "conv_L_cache": 3, "tie_word_embeddings": True,
    "max_position_embeddings": 128000,
    "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                    for i in range(16)]}
GRANITE_4_H_MICRO: dict[str, Any] = {
    "model_type": "granitemoehybrid", "vocab_size": 100352, "hidden_size": 2048,
    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
    "shared_intermediate_size": 8192, "intermediate_size": 8192, "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "mamba_n_heads": 64, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
    "position_embedding_type": "nope", "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0,
    "tie_word_embeddings": True, "max_position_embeddings": 131072,
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]}
# the state-space families: published shapes, their first 8 layers
FALCON_MAMBA_7B_8L: dict[str, Any] = {
    "model_type": "falcon_mamba", "vocab_size": 65024, "hidden_size": 4096,
    "intermediate_size": 8192, "state_size": 16, "num_hidden_layers": 8,
    "time_step_rank": 256, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
    "mixer_rms_eps": 1e-6, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}
MAMBA_CODESTRAL_7B_8L: dict[str, Any] = {
    "model_type": "mamba2", "vocab_size": 32768, "hidden_size": 4096, "num_heads": 128,
    "head_dim": 64, "expand": 2, "state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "num_hidden_layers": 8, "use_bias": False, "use_conv_bias": True,
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}
# Jamba-v0.1's layers (Mamba-1 of 8192 x 16 with rank 256, GQA 32/8, FFN 14336; attention
# at layer 4 of 8, experts on the odd layers) with 4 experts of its 16, top 2: 4.8B
# parameters, so that both servers fit this machine's 24 GB at once in int8
JAMBA_8L_E4: dict[str, Any] = {
    "model_type": "jamba", "vocab_size": 65536, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
    "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4,
    "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
    "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_dt_rank": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "max_position_embeddings": 262144, "tie_word_embeddings": False}
# Kimi-Linear-48B-A3B's layers (KDA of 32 heads x 128, MLA with a 512 latent, 256 experts of
# 1024, top 8, a shared expert; vocabulary 163,840), its first 4 of 27: three KDA layers and
# the first MLA one. In int8 only: 6.3B parameters, both servers in 24 GB.
KIMI_LINEAR_48B_4L: dict[str, Any] = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304,
    "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 4,
    "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "num_local_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 2.446, "linear_num_heads": 32,
    "linear_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
    "max_position_embeddings": 1048576, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
# The newest hybrids at their published widths (transformers 5.23's config defaults, which
# are the released models'), truncated where they would not fit: LFM3 whole (24 layers);
# OLMo-Hybrid-7B's first 8 of 32 layers (6 Gated DeltaNet, 2 attention); MiniMax-Text-01's
# widths (hidden 6144, 64 heads of 128, experts of 9216, vocabulary 200,064) with 4 layers
# (three lightning, one softmax) and 4 of its 32 experts; Ling's (bailing_hybrid) first 6
# layers (five KDA, one MLA; two dense) with 64 of its 512 experts.
LFM3: dict[str, Any] = {"model_type": "lfm3"}
OLMO_HYBRID_7B_8L: dict[str, Any] = {
    "model_type": "olmo_hybrid", "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}
MINIMAX_TEXT_01_4L_E4: dict[str, Any] = {
    "model_type": "minimax", "vocab_size": 200064, "hidden_size": 6144,
    "intermediate_size": 9216, "num_hidden_layers": 4, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attn_alpha_factor": 3.5565588200778455, "full_attn_beta_factor": 1.0,
    "linear_attn_alpha_factor": 3.5565588200778455, "linear_attn_beta_factor": 1.0,
    "mlp_alpha_factor": 3.5565588200778455, "mlp_beta_factor": 1.0}
# MiniMax-Text-01's widths with its first 8 layers (seven lightning, then softmax: its own
# pattern, and the one llama.cpp assumes, a softmax layer every 8th) and 2 of its 32
# experts (both chosen: the MoE reads as a dense layer): 6.7B parameters, what both servers
# hold in 24 GB at 8 bits. Written as published too, for llama.cpp's converter
# (:func:`_publish_minimax`).
MINIMAX_TEXT_01_8L_E2: dict[str, Any] = {
    **MINIMAX_TEXT_01_4L_E4, "num_hidden_layers": 8, "num_local_experts": 2,
    "layer_types": ["linear_attention"] * 7 + ["full_attention"]}
LING_6L_E64: dict[str, Any] = {
    "model_type": "bailing_hybrid", "num_hidden_layers": 6, "num_experts": 64,
    "layer_types": ["linear_attention"] * 5 + ["full_attention"],
    "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 4}
MODELS = {"lfm2-1.2b": LFM2_1_2B, "granite-4.0-h-micro": GRANITE_4_H_MICRO,
          "lfm2-8b-a1b": LFM2_8B_A1B, "qwen3.5-35b-a3b-8l": QWEN35_35B_A3B_8L,
          "falcon-mamba-7b-8l": FALCON_MAMBA_7B_8L,
          "mamba-codestral-7b-8l": MAMBA_CODESTRAL_7B_8L, "jamba-8l-e4": JAMBA_8L_E4,
          "kimi-linear-48b-a3b-4l": KIMI_LINEAR_48B_4L, "lfm3": LFM3,
          "olmo-hybrid-7b-8l": OLMO_HYBRID_7B_8L, "minimax-text-01-4l-e4": MINIMAX_TEXT_01_4L_E4,
          "minimax-text-01-8l-e2": MINIMAX_TEXT_01_8L_E2,
          "ling-6l-e64": LING_6L_E64}
CLASSES = {"lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
           "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM"),
           "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
           "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
           "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM"),
           "mamba2": ("Mamba2Config", "Mamba2ForCausalLM"),
           "jamba": ("JambaConfig", "JambaForCausalLM"),
           "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
           "lfm3": ("Lfm3Config", "Lfm3ForCausalLM"),
           "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM"),
           "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM"),
           "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM")}


# the published checkpoints' names for one expert's projections: (gate, up, down)
EXPERT_NAMES = {"lfm2_moe": ("w1", "w3", "w2"),
                "qwen3_5_moe_text": ("gate_proj", "up_proj", "down_proj"),
                "jamba": ("gate_proj", "up_proj", "down_proj"),
                "kimi_linear": ("w1", "w3", "w2")}
SHARD_BYTES = 2 << 30
COLORS = {"bf16": "C2", "int8": "C0", "int4": "C1"}


def make(name: str, path: Path) -> None:
    """Save ``MODELS[name]`` as its published checkpoint is laid out (experts one by one,
    in shards of 2 GiB with an index), with random bf16 weights (std 0.02; norms 1) and the
    project's tokenizer. Tensor by tensor: the model is never in memory (transformers'
    ``save_pretrained`` of LFM2-8B-A1B took more than this machine's 24 GB)."""
    import json
    import shutil

    import transformers
    from safetensors.torch import save_file

    fields = dict(MODELS[name])
    kind = fields.pop("model_type")
    config_name, model_name = CLASSES[kind]
    config = getattr(transformers, config_name)(**fields)
    model_cls = getattr(transformers, model_name)
    if kind in SAVED_WHOLE:
        _save_whole(model_cls, config, path)
        return
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in model_cls(config).state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    config.architectures = [model_cls.__name__]  # what llama.cpp's converter reads
    config.save_pretrained(path)
    if kind == "granitemoehybrid":  # transformers saves its own names; llama.cpp reads these
        _publish_layer_types(path / "config.json", fields["layer_types"])
    if kind == "kimi_linear":
        _publish_kimi(path / "config.json", fields)
    shutil.copy(Path(__file__).resolve().parents[1] / "weights" / "tokenizer.json",
                path / "tokenizer.json")
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    for tname, shape in shapes.items():
        if tname == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the checkpoint holds the embedding table only
        for out_name, out_shape in _published(tname, shape, EXPERT_NAMES.get(kind),
                                              kind == "kimi_linear"):
            shard[out_name] = _random(out_name, out_shape, gen)
            if sum(t.numel() * 2 for t in shard.values()) >= SHARD_BYTES:
                _write(path, shard, index, save_file)
    if shard:
        _write(path, shard, index, save_file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


# families whose published tensor names transformers' own save writes (its conversion
# mapping: stacked experts one by one, q / k / v conv kernels apart, renamed norms) and that
# fit this machine in bf16: built whole and saved by ``save_pretrained``
SAVED_WHOLE = {"lfm3", "olmo_hybrid", "minimax", "bailing_hybrid"}


def _save_whole(model_cls: Any, config: Any, path: Path) -> None:
    """``model_cls(config)`` with random bf16 weights (transformers' initialisation), saved
    with ``save_pretrained`` and the project's tokenizer."""
    import shutil

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = model_cls(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path, max_shard_size="2GB")
    if config.model_type == "olmo_hybrid":
        _resplit_olmo_convs(path, config)
    if config.model_type == "minimax":
        _publish_minimax(path / "config.json")
    shutil.copy(Path(__file__).resolve().parents[1] / "weights" / "tokenizer.json",
                path / "tokenizer.json")
    # the tokenizer as it is, for the converters' AutoTokenizer
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')


def _publish_minimax(config: Path) -> None:
    """MiniMax-Text-01's config as published, beside transformers' fields (what llama.cpp's
    converter reads): its class name, the residual factors' published names and the rotary
    width (the converter writes it; this server rotates as transformers does); without
    transformers' decay buffers."""
    import json

    data = json.loads(config.read_text())
    data["architectures"] = ["MiniMaxText01ForCausalLM"]
    for kind, ours in (("full_attention", "full_attn"), ("linear_attention", "linear_attn"),
                       ("mlp", "mlp")):
        data[f"layernorm_{kind}_alpha"] = data[f"{ours}_alpha_factor"]
        data[f"layernorm_{kind}_beta"] = data[f"{ours}_beta_factor"]
    data["rotary_dim"] = data["head_dim"]
    data["attn_type_list"] = [int(t == "full_attention") for t in data["layer_types"]]
    config.write_text(json.dumps(data, indent=2))
    _drop_tensors(config.parent, ("_decay", ".slope_rate"))


def _drop_tensors(path: Path, endings: tuple[str, ...]) -> None:
    """Remove from the checkpoint at ``path`` the tensors whose names end in ``endings``
    (transformers saves MiniMax's decay buffers, which the published files do not hold)."""
    import json

    from safetensors.torch import load_file, save_file

    index_file = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
             if index_file.exists() else ["model.safetensors"])
    kept: dict[str, str] = {}
    for file in files:
        tensors = {k: v for k, v in load_file(path / file).items() if not k.endswith(endings)}
        save_file(tensors, path / file, metadata={"format": "pt"})
        kept.update(dict.fromkeys(tensors, file))
    if index_file.exists():
        index_file.write_text(json.dumps({"metadata": {}, "weight_map": kept}))


def _resplit_olmo_convs(path: Path, config: Any) -> None:
    """transformers 5.23 saves OLMo-Hybrid's q, k and v conv kernels as three equal thirds of
    the joined kernel; the published checkpoints keep each at its own width (q and k: the
    key dim, v: the value dim), as the loader reads them."""
    import json

    from safetensors.torch import load_file, save_file

    key = config.linear_num_key_heads * config.linear_key_head_dim
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    for file in sorted(set(index.values())):
        tensors = load_file(path / file)
        for name in [n for n in tensors if n.endswith(".q_conv1d.weight")]:
            prefix = name.removesuffix("q_conv1d.weight")
            parts = [tensors[f"{prefix}{p}_conv1d.weight"] for p in "qkv"]
            q, k, v = torch.cat(parts).split([key, key, sum(t.shape[0] for t in parts)
                                              - 2 * key])
            tensors.update({f"{prefix}q_conv1d.weight": q.contiguous(),
                            f"{prefix}k_conv1d.weight": k.contiguous(),
                            f"{prefix}v_conv1d.weight": v.contiguous()})
        save_file(tensors, path / file, metadata={"format": "pt"})


def _publish_kimi(config: Path, fields: dict[str, Any]) -> None:
    """Kimi-Linear's config as published (what llama.cpp's converter reads): the linear
    layers' ``linear_attn_config`` with 1-based layer lists, and the expert counts' names."""
    import json

    data = json.loads(config.read_text())
    types = fields["layer_types"]
    data["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "head_dim": fields["linear_head_dim"], "num_heads": fields["linear_num_heads"],
        "short_conv_kernel_size": fields["linear_conv_kernel_dim"]}
    data.update(num_experts=fields["num_local_experts"],
                num_experts_per_token=fields["num_experts_per_tok"],
                num_shared_experts=fields["n_shared_experts"], first_k_dense_replace=1,
                moe_router_activation_func="sigmoid")
    config.write_text(json.dumps(data, indent=2))


def _publish_layer_types(config: Path, types: list[str]) -> None:
    """Write the layer types as the published config names them."""
    import json

    data = json.loads(config.read_text())
    data["layer_types"] = types
    config.write_text(json.dumps(data, indent=2))


def _published(name: str, shape: tuple[int, ...], names: tuple[str, str, str] | None,
               kimi: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """A tensor of transformers' module as the published checkpoint names it: the stacked
    experts one by one (``names``: a family's names for one expert's projections); for
    Kimi-Linear, its experts under ``block_sparse_moe``, the forget gate's tensors unnested
    and the q, k and v conv kernels apart."""
    if kimi:
        if any(f".mlp.{part}" in name for part in ("experts", "gate.", "shared_experts")):
            name = name.replace(".mlp.", ".block_sparse_moe.")  # the dense layers keep mlp
        name = name.replace(".forget_gate.", ".")
        if name.endswith(".self_attn.conv1d.weight"):
            prefix, third = name.removesuffix("conv1d.weight"), shape[0] // 3
            return [(f"{prefix}{p}_conv1d.weight", (third, *shape[1:])) for p in "qkv"]
    if names is None:
        return [(name, shape)]
    if name.endswith(".experts.gate_up_proj"):
        prefix, half = name.removesuffix(".gate_up_proj"), shape[1] // 2
        return [(f"{prefix}.{e}.{n}.weight", (half, shape[2]))
                for e in range(shape[0]) for n in names[:2]]
    if name.endswith(".experts.down_proj"):
        prefix = name.removesuffix(".down_proj")
        return [(f"{prefix}.{e}.{names[2]}.weight", shape[1:]) for e in range(shape[0])]
    return [(name, shape)]


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("expert_bias"):
        return torch.zeros(shape)
    if len(shape) == 1:
        fill = 0.0 if name.endswith(("A_log", "dt_bias")) else 1.0
        return torch.full(shape, fill, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)


def _write(path: Path, shard: dict[str, torch.Tensor], index: dict[str, str],
           save_file: Any) -> None:
    file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
    save_file(shard, str(path / file), metadata={"format": "pt"})
    index.update(dict.fromkeys(shard, file))
    shard.clear()


def active_bytes(path: Path, kind: str) -> dict[str, float]:
    """Parameters, and bytes as served under ``kind`` (:func:`linserve.model.loader.weight_bytes`),
    of the whole model and of what one batch-1 token reads: every weight outside the
    experts plus ``top_k`` experts a MoE layer. From the config alone (a meta module)."""
    from linserve.model import loader
    from linserve.model.layers.moe import SparseMoE
    from linserve.model.served import ServedModule

    described = loader.family_loader(path).load(path, torch.bfloat16, True, False)  # no weights
    assert isinstance(described, ServedModule)
    module = described.module
    moes = [m for m in module.modules() if isinstance(m, SparseMoE)]  # none in dense models
    experts = sum(p.numel() for m in moes for p in m.experts.parameters())
    chosen = sum(m.spec.top_k * sum(p.numel() for p in m.experts[0].parameters())
                 for m in moes)
    total = module.n_params()
    active = total - experts + chosen
    # what a token reads: the active weights but one row of the embedding table
    emb = module.model.embed_tokens.weight
    tied = module.lm_head is None
    read = active - (0 if tied else emb.numel())
    return {"params": total, "active_params": active,
            "active_bytes": loader.weight_bytes(active, torch.bfloat16, memory.TYPES[kind]),
            "read_bytes": loader.weight_bytes(read, torch.bfloat16, memory.TYPES[kind])}


def plot(result: dict[str, Any]) -> None:
    """Decode tokens/s against active parameters: both servers, each weight type, batch 1
    and 16 streams."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, load in zip(axes, ("batch1", "streams"), strict=True):
        for model, entry in result["models"].items():
            x = entry["active_params"] / 1e9
            for kind, row in entry["types"].items():
                for who, marker in (("ours", "o"), ("llama_server", "s")):
                    y = row[who][load]["output_tokens_per_s"]
                    ax.scatter(x, y, marker=marker, color=COLORS[kind],
                               edgecolors="black" if who == "ours" else "none")
                    ax.annotate(f"{model} {kind} {'ours' if who == 'ours' else 'llama'}",
                                (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("active parameters a token (B)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("one stream" if load == "batch1" else "16 streams (aggregate)")
        ax.grid(alpha=0.3)
    fig.suptitle("Decode: this server (circles) against llama-server (squares); "
                 "bf16 green, int8/Q8_0 blue, int4/Q4_0 orange", fontsize=9)
    save_figure(fig, "families")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["lfm2-1.2b"], choices=list(MODELS))
    p.add_argument("--root", type=Path, default=Path("/tmp"), help="where checkpoints live")
    p.add_argument("--make", action="store_true", help="build missing checkpoints first")
    p.add_argument("--kinds", nargs="+", default=list(memory.TYPES), choices=list(memory.TYPES))
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=0,
                   help="also time a prompt of about this many tokens (0: not)")
    p.add_argument("--prefill-requests", type=int, default=2,
                   help="prompts timed for --prefill (the median is kept)")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    command = "python -m bench.families " + " ".join(argv if argv is not None else sys.argv[1:])
    result = saved_models("families")
    if args.plot_only:
        plot(result)
        return
    read_gbs = read_bandwidth_gbs()
    read_gbs_2 = read_bandwidth_gbs(threads=2)  # what two threads together reach
    for name in args.models:
        path = args.root / name
        if not (path / "config.json").exists():
            if not args.make:
                raise SystemExit(f"{path} is missing: pass --make")
            make(name, path)
        entry: dict[str, Any] = result["models"].get(name) or {"types": {}}
        entry.update(command=command, machine=machine(), read_gbs_one_thread=read_gbs,
                     read_gbs_two_threads=read_gbs_2)
        for kind in args.kinds:
            sizes = active_bytes(path, kind)
            entry.update(params=sizes["params"], active_params=sizes["active_params"])
            run = memory.one_kind(argparse.Namespace(
                checkpoint=path, streams=args.streams, tokens=args.tokens,
                prefill=args.prefill, prefill_requests=args.prefill_requests), kind)
            tok_s = run["ours"]["batch1"]["output_tokens_per_s"]
            run["active_bytes"] = sizes["active_bytes"]
            run["command"], run["machine"] = command, machine()  # weight types of other runs stay
            run["roofline_fraction_batch1"] = sizes["active_bytes"] * tok_s / (2 * read_gbs * 1e9)
            # the same against two threads' measured read bandwidth, and per token of the
            # decode alone (time per output token, not the run's tokens/s with its first)
            tpot = run["ours"]["batch1"]["tpot_ms"]["mean"]
            run["roofline_fraction_batch1_two_threads"] = (
                sizes["read_bytes"] / (tpot / 1e3) / (read_gbs_2 * 1e9))
            entry["types"][kind] = run
            print(name, kind, run["ratios"], "roofline",
                  round(run["roofline_fraction_batch1"], 3), "(two threads, per token",
                  round(run["roofline_fraction_batch1_two_threads"], 3), ")", flush=True)
            result["models"][name] = entry
            write_json("families", {"result": result})
    plot(result)


if __name__ == "__main__":
    main()
