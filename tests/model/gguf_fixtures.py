"""GGUF files for the tests, written as users get them: by llama.cpp's own
``convert_hf_to_gguf.py`` (the version the ``llama-cpp-python==0.3.36`` sdist vendors, run on
its own gguf-py; nothing of llama.cpp is built), from tiny random checkpoints made with
``transformers``. And files written directly with gguf-py's ``GGUFWriter``, for block formats
the converter cannot write (the K-quants, which only ``llama-quantize`` writes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES
from safetensors.torch import load_file, save_file

from bench import llamacpp_assets
from bench.llamacpp_compare import converter_view
from tests.paths import ROOT

SHIM = ROOT / "bench" / "gguf_pre_shim.py"


def convert(hf_dir: Path, out: Path, outtype: str = "f32", pre: str | None = "gpt-2",
            extra: tuple[str, ...] = ()) -> Path:
    """``hf_dir`` converted to ``out`` by llama.cpp's converter. ``pre``: the pre-tokenizer
    to name for a vocabulary the converter does not recognise (the project's tokenizer is
    GPT-2's split, bench/gguf_pre_shim.py); None: the converter's own recognition.
    ``extra``: more converter arguments (``--no-mtp`` for a Qwen checkpoint without MTP
    layers, which the converter otherwise expects)."""
    return convert_many([Conversion(hf_dir, out, outtype, pre, extra)])[0]


@dataclass(frozen=True)
class Conversion:
    """One :func:`convert` call's arguments."""

    hf_dir: Path
    out: Path
    outtype: str = "f32"
    pre: str | None = "gpt-2"
    extra: tuple[str, ...] = ()


def convert_many(jobs: list[Conversion]) -> list[Path]:
    """Each job as :func:`convert` does it, all in one converter process (its imports take
    6.8 s a process on two AVX2 cores, most of a tiny model's conversion)."""
    src = llamacpp_assets.converter()
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "NO_LOCAL_GGUF": ""}
    listing = [{"argv": [str(converter_view(as_published(j.hf_dir))), "--outfile", str(j.out),
                         "--outtype", j.outtype, *j.extra], "pre": j.pre} for j in jobs]
    jobs_file = jobs[0].out.with_name(f"{jobs[0].out.name}.jobs.json")
    jobs_file.write_text(json.dumps(listing))
    done = subprocess.run([sys.executable, str(SHIM), "--batch", str(jobs_file), str(src)],
                          env=env, capture_output=True, text=True, timeout=600 * len(jobs))
    if done.returncode != 0:
        pytest.fail(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    errors = [(j.out.name, r["error"]) for j, r in
              zip(jobs, json.loads(jobs_file.read_text()), strict=True) if r["error"]]
    if errors:
        pytest.fail(f"convert_hf_to_gguf.py failed on {errors[0][0]}:\n{errors[0][1]}")
    return [j.out for j in jobs]


# transformers 5 saves some configs with its own names for layer kinds; the converter reads
# the names the published checkpoints use (Granite-4.0-H's "mamba" / "attention",
# Nemotron-H's hybrid_override_pattern, Bamba's attn_rotary_emb), so the tests write those, as
# the Hub files have them
PUBLISHED_KINDS = {"linear_attention": ("mamba", "M"), "full_attention": ("attention", "*"),
                   "mlp": ("mlp", "-"), "moe": ("moe", "E")}


def as_published(hf_dir: Path) -> Path:
    """Rewrite ``hf_dir``'s config.json with the published checkpoints' layer-kind fields."""
    path = hf_dir / "config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") == "granitemoehybrid":
        cfg["layer_types"] = [PUBLISHED_KINDS.get(t, (t,))[0] for t in cfg["layer_types"]]
    if cfg.get("model_type") == "nemotron_h" and "layers_block_type" in cfg:
        cfg["hybrid_override_pattern"] = "".join(PUBLISHED_KINDS[t][1]
                                                 for t in cfg["layers_block_type"])
    if cfg.get("model_type") == "falcon_h1" and cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("model_type") == "qwen3_next":  # llama.cpp assumes the published top-k norm
        cfg["norm_topk_prob"] = True
    if cfg.get("model_type") == "bamba":  # Bamba-9B names its rotary width
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        rotary = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
        cfg["attn_rotary_emb"] = int(head_dim * rotary)
    if cfg.get("model_type") == "kimi_linear":
        _publish_kimi(hf_dir, cfg)
    path.write_text(json.dumps(cfg, indent=2))
    tok_cfg = hf_dir / "tokenizer_config.json"
    if not tok_cfg.exists():  # the tokenizer as it is (GPT-NeoX's class would add a token)
        tok_cfg.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return hf_dir


def _publish_kimi(hf_dir: Path, cfg: dict[str, Any]) -> None:
    """Kimi-Linear as published (what llama.cpp's converter reads): ``linear_attn_config``
    with 1-based layer lists, ``first_k_dense_replace``, and the dense layers' MLP under
    ``mlp`` (transformers saves it under ``block_sparse_moe``)."""
    types, mlp = cfg["layer_types"], cfg.get("mlp_layer_types") or []
    cfg["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "head_dim": cfg["linear_head_dim"], "num_heads": cfg["linear_num_heads"],
        "short_conv_kernel_size": cfg["linear_conv_kernel_dim"]}
    cfg["first_k_dense_replace"] = next((i for i, k in enumerate(mlp) if k != "dense"),
                                        len(mlp))
    cfg["moe_router_activation_func"] = "sigmoid"
    file = hf_dir / "model.safetensors"
    tensors = load_file(file)
    save_file({re.sub(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate|up|down)_proj\.",
                      r"\1.mlp.\2_proj.", k): v for k, v in tensors.items()},
              file, metadata={"format": "pt"})


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0
                  ) -> np.ndarray:
    """``rows`` rows of ``cols`` values in ``qtype``'s blocks, with random bytes but finite
    fp16 scales (every block format keeps its fp16 scales first or last, as gguf-py's
    dequantizers read them): ``[rows, bytes per row]`` uint8."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    # Q8_0's values reach 127 where the 4-bit formats' reach 15: its scales are smaller, so
    # that every format's weights have about the same size
    top = 0.05 / 16 if qtype == GGMLQuantizationType.Q8_0 else 0.05
    for at in _fp16_offsets(qtype):
        scale = rng.uniform(-top, top, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, at:at + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    if qtype == GGMLQuantizationType.Q8_0:  # llama.cpp's values are in [-127, 127]
        values = raw[:, :, 2:]
        values[values == 128] = 129
    return raw.reshape(rows, -1)


def _fp16_offsets(qtype: GGMLQuantizationType) -> tuple[int, ...]:
    """Byte offsets of the fp16 scales in one block of ``qtype`` (ggml-common.h)."""
    q = GGMLQuantizationType
    return {q.Q4_0: (0,), q.Q4_1: (0, 2), q.Q5_0: (0,), q.Q5_1: (0, 2), q.Q8_0: (0,),
            q.Q2_K: (80, 82), q.Q3_K: (108,), q.Q4_K: (0, 2), q.Q5_K: (0, 2), q.Q6_K: (208,),
            q.IQ4_NL: (0,), q.IQ4_XS: (0,), q.IQ2_XXS: (0,)}[qtype]


Pick = Callable[[str, tuple[int, ...]], GGMLQuantizationType | None]
BLOCK_32 = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
            GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.IQ4_NL)
BLOCK_256 = (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
             GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ4_XS)


def cycle_formats() -> Pick:
    """Each matrix in the next block format that fits its rows (K-quants where they are
    multiples of 256, the 32-blocks elsewhere), vectors as they are: a mix like
    llama-quantize's, with every format present."""
    count = [0]

    def pick(name: str, shape: tuple[int, ...]) -> GGMLQuantizationType | None:
        del name
        if len(shape) < 2 or shape[-1] % 32:
            return None
        kinds = BLOCK_256 + BLOCK_32 if shape[-1] % 256 == 0 else BLOCK_32
        count[0] += 1
        return kinds[count[0] % len(kinds)]

    return pick


def requantize(src: Path, out: Path, pick: Pick) -> Path:
    """A copy of the GGUF ``src`` whose tensors ``pick`` names a format for are stored in it,
    with random blocks (the test compares the loader with gguf-py's dequantizer, not with
    the original values); every other tensor and all metadata as they are."""
    def tensor(i: int, name: str, shape: tuple[int, ...], data: np.ndarray,
               qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
        want = pick(name, shape)
        if want is None:
            return data, qtype
        raw = random_blocks(want, int(np.prod(shape[:-1])), shape[-1], seed=i)
        return raw.reshape(*shape[:-1], -1), want

    return _rewrite(src, out, tensor)


def dequantized_copy(src: Path, out: Path) -> Path:
    """A copy of the GGUF ``src`` with every tensor stored as F32, by gguf-py's
    dequantizer."""
    def tensor(i: int, name: str, shape: tuple[int, ...], data: np.ndarray,
               qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
        del i, name
        values = quants.dequantize(data, qtype).astype(np.float32).reshape(shape)
        return values, GGMLQuantizationType.F32

    return _rewrite(src, out, tensor)


Rewrite = Callable[[int, str, tuple[int, ...], np.ndarray, GGMLQuantizationType],
                   tuple[np.ndarray, GGMLQuantizationType]]


def _rewrite(src: Path, out: Path, tensor: Rewrite) -> Path:
    """Copy the GGUF ``src`` to ``out``: all metadata, and each tensor as ``tensor`` gives
    it (index, name, PyTorch-order shape, stored data, type -> data, type)."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(out), arch=str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for i, t in enumerate(reader.tensors):
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        data, qtype = tensor(i, t.name, shape, np.array(t.data), t.tensor_type)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
