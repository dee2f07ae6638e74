"""BlinkDL's ``.pth`` checkpoints of RWKV-7, RWKV-6 and RWKV-4 (``emb.weight``,
``blocks.N.att.*``, as the ``rwkv`` package reads them), each seen as the Hugging Face folder
of the same weights: a config dict from the tensors' shapes, the folder's tensor names, and
each tensor in its layout. RWKV-7 reads as fla-hub's folder (the LoRA matrices transposed,
the ``[1, 1, d]`` vectors flattened where fla's are); RWKV-6 and RWKV-4 as the ``rwkv.*``
folders (renamed only, as their converters do). A ``.pth`` is a
pickle: it is read with ``torch.load(weights_only=True)``, and a file that needs more is
refused in one line. ``linserve serve model.pth`` or a folder holding one ``.pth`` (and no
``config.json``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from linserve.model.checkpoint_path import is_pth as is_pth  # re-exported
from linserve.model.checkpoint_path import pth_file
from linserve.model.info import CheckpointError


@functools.lru_cache(maxsize=2)
def _state_dict(file: Path, stamp: tuple[int, int]) -> dict[str, torch.Tensor]:
    del stamp  # the cache key: a rewritten file is read again
    try:
        try:
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # an old (non-zip) serialization cannot be mapped
            sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle's and torch's own errors, many types
        raise CheckpointError(f"{file}: not a weights-only .pth checkpoint "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
                              ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{file}: not a state dict of tensors")
    return sd


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    file = pth_file(path)
    assert file is not None
    st = file.stat()
    return _state_dict(file, (st.st_mtime_ns, st.st_size))


@dataclass(frozen=True)
class Source:
    """Where an fla tensor comes from: the ``.pth`` name, transposed or not, and its shape."""

    name: str
    transpose: bool
    shape: tuple[int, ...]


LORA = {"0": ("lora.2.bias", False), "1": ("lora.0.weight", True), "2": ("lora.2.weight", True)}
PROJ = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj",
        "ln_x": "g_norm"}
NORMS = {"ln0": "pre_norm", "ln1": "attn_norm", "ln2": "ffn_norm"}
TOP = {"emb.weight": "model.embeddings.weight", "ln_out.weight": "model.norm.weight",
       "ln_out.bias": "model.norm.bias", "head.weight": "lm_head.weight"}


def version(sd: dict[str, torch.Tensor]) -> int:
    """The RWKV generation of a ``.pth``'s tensors (as the ``rwkv`` package tells them
    apart; 5 for RWKV-5, which is not served)."""
    if "blocks.0.att.r_k" in sd:
        return 7
    if "blocks.0.att.time_maa_x" in sd:
        return 6
    return 5 if "blocks.0.att.ln_x.weight" in sd else 4


_V4_MIX = {"time_mix_k": "time_mix_key", "time_mix_v": "time_mix_value",
           "time_mix_r": "time_mix_receptance"}


def hf_name(name: str, generation: int) -> str | None:
    """An RWKV-6 or RWKV-4 tensor's name in the Hugging Face folder (``rwkv.blocks.N.*``,
    as the folders' converters rename them)."""
    if name == "head.weight":
        return name
    if name.startswith("emb."):
        return "rwkv.embeddings." + name.removeprefix("emb.")
    if name.startswith("ln_out."):
        return "rwkv." + name
    m = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.(.+)", name)
    if m is None:
        return None
    layer, part, leaf = m.groups()
    if generation == 4:
        leaf = _V4_MIX.get(leaf, leaf)
    if part == "att" and leaf == "time_state":
        return None  # a state merged into the weights: the model's initial state
    part = {"ln0": "pre_ln", "att": "attention", "ffn": "feed_forward"}.get(part, part)
    return f"rwkv.blocks.{layer}.{part}.{leaf}"


def time_states(path: Path) -> dict[str, torch.Tensor]:
    """The tuned state a ``.pth`` holds beside its weights (``blocks.N.att.time_state``,
    which BlinkDL's reference starts every sequence from), as a state file's tensors."""
    return {n: t for n, t in state_dict(path).items() if n.endswith(".att.time_state")}


def fla_name(name: str) -> tuple[str, bool] | None:
    """A BlinkDL tensor's fla name and whether it is transposed there (None: unused, such
    as layer 0's v₀, v₁, v₂)."""
    if name in TOP:
        return TOP[name], False
    m = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.(\w+)(?:\.(weight|bias))?", name)
    if m is None:
        return None
    layer, part, leaf, kind = m.groups()
    prefix = f"model.layers.{layer}"
    if part in NORMS:
        return f"{prefix}.{NORMS[part]}.{leaf}", False
    if part == "att" and leaf == "time_state":
        return None  # a state merged into the weights: the model's initial state
    if part == "att":
        lora = re.fullmatch(r"([wavg])([012])", leaf)
        if lora:
            if layer == "0" and lora.group(1) == "v":
                return None
            tail, transposed = LORA[lora.group(2)]
            return f"{prefix}.attn.{lora.group(1)}_lora.{tail}", transposed
        if leaf in PROJ:
            return f"{prefix}.attn.{PROJ[leaf]}.{kind}", False
        return f"{prefix}.attn.{leaf}", False
    if part == "ffn":
        return f"{prefix}.ffn.{leaf}" + (f".{kind}" if kind else ""), False
    return None


def _fla_shape(fla: str, shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    """fla's shape of a tensor stored with ``shape`` in the ``.pth``."""
    if transposed:
        return tuple(reversed(shape))
    if re.search(r"\.attn\.x_\w$", fla):
        return (1, 1, shape[-1])
    if re.search(r"(\.attn\.k_[ka]|\.ffn\.x_k|lora\.2\.bias)$", fla):
        return (shape[-1],)
    return shape


def sources(path: Path) -> dict[str, Source]:
    """Every folder tensor the ``.pth`` at ``path`` holds, and where it comes from."""
    out: dict[str, Source] = {}
    sd = state_dict(path)
    generation = version(sd)
    for name, t in sd.items():
        if generation != 7:
            renamed = hf_name(name, generation)
            if renamed is not None:
                out[renamed] = Source(name, False, tuple(t.shape))
            continue
        found = fla_name(name)
        if found is not None:
            fla, transposed = found
            out[fla] = Source(name, transposed, _fla_shape(fla, tuple(t.shape), transposed))
    return out


def read(path: Path, fla: str) -> torch.Tensor:
    """The fla tensor ``fla`` of the ``.pth`` at ``path``, in fla's layout."""
    src = sources(path)[fla]
    t = state_dict(path)[src.name]
    return (t.t() if src.transpose else t).reshape(src.shape)


def config(path: Path) -> dict[str, Any]:
    """The folder's config.json for the ``.pth`` at ``path``, from its tensors' shapes.
    Raises :class:`CheckpointError` for an RWKV generation not served."""
    sd = state_dict(path)
    generation = version(sd)
    if "emb.weight" not in sd or not any(n.startswith("blocks.") for n in sd):
        raise CheckpointError(f"{path}: not an RWKV .pth (no emb.weight and blocks.N.*)")
    if generation == 5:
        raise CheckpointError(f"{path}: a .pth of RWKV-5; RWKV-4, 6 and 7 .pth files are "
                              "served")
    layers = 1 + max(int(n.split(".")[1]) for n in sd if n.startswith("blocks."))
    vocab, hidden = sd["emb.weight"].shape
    common = {"vocab_size": int(vocab), "hidden_size": int(hidden), "num_hidden_layers": layers,
              "intermediate_size": int(sd["blocks.0.ffn.key.weight"].shape[0]),
              "layer_norm_epsilon": 1e-5, "rescale_every": 0, "tie_word_embeddings": False}
    if generation == 6:
        heads, head = sd["blocks.0.att.time_faaaa"].shape[-2:]
        return {**common, "model_type": "rwkv6", "head_size": int(head),
                "attention_hidden_size": int(heads * head),
                "time_mix_extra_dim": int(sd["blocks.0.att.time_maa_w2"].shape[1]),
                "time_decay_extra_dim": int(sd["blocks.0.att.time_decay_w1"].shape[1])}
    if generation == 4:
        return {**common, "model_type": "rwkv",
                "attention_hidden_size": int(sd["blocks.0.att.key.weight"].shape[0])}
    return _rwkv7_config(sd, layers)


def _rwkv7_config(sd: dict[str, torch.Tensor], layers: int) -> dict[str, Any]:
    head_dim = sd["blocks.0.att.r_k"].shape[1]
    vocab, hidden = sd["emb.weight"].shape
    v_rank = sd["blocks.1.att.v1"].shape[1] if "blocks.1.att.v1" in sd else 32
    return {"model_type": "rwkv7", "vocab_size": int(vocab), "hidden_size": int(hidden),
            "num_hidden_layers": layers, "head_dim": int(head_dim),
            "decay_low_rank_dim": int(sd["blocks.0.att.w1"].shape[1]),
            "a_low_rank_dim": int(sd["blocks.0.att.a1"].shape[1]),
            "v_low_rank_dim": int(v_rank),
            "gate_low_rank_dim": int(sd["blocks.0.att.g1"].shape[1]),
            "intermediate_size": int(sd["blocks.0.ffn.key.weight"].shape[0]),
            "norm_eps": 1e-5, "group_norm_eps": 64e-5, "tie_word_embeddings": False}
