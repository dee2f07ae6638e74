"""BlinkDL's ``.pth`` checkpoints of RWKV-7 (``emb.weight``, ``blocks.N.att.*``, as the
``rwkv`` package reads them), seen as the fla-hub folder of the same weights: a config dict
from the tensors' shapes, fla's tensor names, and each tensor in fla's layout (the LoRA
matrices transposed, the ``[1, 1, d]`` vectors flattened where fla's are). A ``.pth`` is a
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

from linserve.model.interface import CheckpointError


def pth_file(path: Path) -> Path | None:
    """The ``.pth`` checkpoint ``path`` is or holds (a folder with exactly one and no
    ``config.json``); None otherwise."""
    if path.is_file():
        return path if path.suffix == ".pth" else None
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.pth"))
        return found[0] if len(found) == 1 else None
    return None


def is_pth(path: Path) -> bool:
    return pth_file(path) is not None


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
    """Every fla tensor the ``.pth`` at ``path`` holds, and where it comes from."""
    out: dict[str, Source] = {}
    for name, t in state_dict(path).items():
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
    """fla's config.json for the ``.pth`` at ``path``, from its tensors' shapes. Raises
    :class:`CheckpointError` for another RWKV version."""
    sd = state_dict(path)
    if "blocks.0.att.r_k" not in sd:
        version = "RWKV-6" if "blocks.0.att.time_maa_x" in sd else "not RWKV-7"
        raise CheckpointError(f"{path}: a .pth of {version}; RWKV-7 .pth files are served")
    layers = 1 + max(int(n.split(".")[1]) for n in sd if n.startswith("blocks."))
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
