"""A vision tower in llama.cpp's ``mmproj`` GGUF file (``llama-server --mmproj``), read as
the Hugging Face checkpoint held it: ``clip.vision.*`` keys as a ``vision_config``, and the
``v.*`` / ``mm.*`` tensors under their ``model.visual.*`` names, with the converter's
changes undone (the Conv3d patch embedding it split into two Conv2d halves,
``v.patch_embd.weight`` and ``.weight.1``, stacked back along time). Projector types read:
``qwen3vl_merger`` (Qwen3-VL without deepstack layers: Qwen3.5's).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from linserve.model.fingerprint import files_fingerprint
from linserve.model.gguf.checkpoint import dequantize
from linserve.model.gguf.files import GGUFFileError, GGUFModel, open_model

PROJECTORS = ("qwen3vl_merger",)
_BLOCK = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
          "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_FIXED = {"mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2", "v.post_ln": "merger.norm",
          "v.position_embd": "pos_embed", "v.patch_embd": "patch_embed.proj"}
PREFIX = "model.visual."


class MMProj:
    """The tower of the mmproj file at ``path`` (GGUFFileError, one line, for a file that is
    not one, or of a projector not served)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model: GGUFModel = open_model(path)
        meta = self.model.meta
        if self.model.arch != "clip" or not meta.get("clip.has_vision_encoder"):
            raise GGUFFileError(f"{path}: not an mmproj file with a vision encoder "
                                f"(general.architecture {self.model.arch!r})")
        kind = str(meta.get("clip.projector_type") or meta.get("clip.vision.projector_type"))
        if kind not in PROJECTORS:
            raise GGUFFileError(f"{path}: projector type {kind!r} is not served (served: "
                                f"{', '.join(PROJECTORS)})")
        if any(meta.get("clip.vision.is_deepstack_layers") or []):
            raise GGUFFileError(f"{path}: deepstack layers (Qwen3-VL's) are not served")
        self.names = self._names()

    def _key(self, key: str) -> Any:
        full = f"clip.vision.{key}"
        if full not in self.model.meta:
            raise GGUFFileError(f"{self.path}: {full} is missing")
        return self.model.meta[full]

    def vision_config(self) -> dict[str, Any]:
        """The ``vision_config`` of Qwen3.5's checkpoint this tower came from."""
        pos = self.model.tensors["v.position_embd.weight"].shape[0]
        return {"depth": int(self._key("block_count")),
                "hidden_size": int(self._key("embedding_length")),
                "intermediate_size": int(self._key("feed_forward_length")),
                "num_heads": int(self._key("attention.head_count")),
                "out_hidden_size": int(self._key("projection_dim")),
                "patch_size": int(self._key("patch_size")),
                "spatial_merge_size": int(self.model.meta.get(
                    "clip.vision.spatial_merge_size", 2)),
                "temporal_patch_size": 2, "num_position_embeddings": int(pos),
                "hidden_act": "gelu_pytorch_tanh"}

    def normalization(self) -> tuple[list[float], list[float]]:
        return (list(self.model.meta.get("clip.vision.image_mean", [0.5] * 3)),
                list(self.model.meta.get("clip.vision.image_std", [0.5] * 3)))

    def _names(self) -> dict[str, tuple[str, ...]]:
        """Hugging Face name -> the GGUF tensors it is read from."""
        out: dict[str, tuple[str, ...]] = {}
        for gname in self.model.tensors:
            base, _, tail = gname.rpartition(".")
            if tail not in ("weight", "bias"):
                continue  # the patch embedding's second half (.weight.1) joins the first
            block = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
            if block and block.group(2) in _BLOCK:
                hf = f"blocks.{block.group(1)}.{_BLOCK[block.group(2)]}"
            elif base in _FIXED:
                hf = _FIXED[base]
            else:
                continue
            parts = (gname, f"{gname}.1") if base == "v.patch_embd" and tail == "weight" \
                else (gname,)
            out[f"{PREFIX}{hf}.{tail}"] = parts
        return out

    def read(self, hf_name: str) -> torch.Tensor:
        """A tensor as the Hugging Face checkpoint held it (fp32 where it was quantized)."""
        parts = [dequantize(self.model.tensors[g]) for g in self.names[hf_name]]
        return parts[0] if len(parts) == 1 else torch.stack(parts, dim=2)

    def shape(self, hf_name: str) -> tuple[int, ...]:
        parts = self.names[hf_name]
        shape = tuple(int(s) for s in self.model.tensors[parts[0]].shape)
        return shape if len(parts) == 1 else (*shape[:2], len(parts), *shape[2:])

    def fingerprint(self) -> str:
        return files_fingerprint(list(self.model.files))


@lru_cache(maxsize=2)
def mmproj(path: Path) -> MMProj:
    return MMProj(path)


def is_mmproj(path: Path) -> bool:
    """Whether ``path`` is an mmproj file (a GGUF whose architecture is ``clip``)."""
    if path.suffix != ".gguf" or not path.is_file():
        return False
    try:
        return open_model(path).arch == "clip"
    except GGUFFileError:
        return False
