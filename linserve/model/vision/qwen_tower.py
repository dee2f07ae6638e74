"""Qwen3.5's vision tower (Qwen3-VL's without its deepstack taps): patches -> a Conv3d
patch embedding (a matrix product over each flattened patch), plus a learned square
position table resized bilinearly to the image's grid; ViT blocks with 2-D rotary
attention over the whole image; the merger (LayerNorm, each 2 × 2 block of patches
concatenated, Linear, GELU, Linear) to the text model's width.

Parameter names follow transformers' ``Qwen3_5VisionModel`` (``model.visual.*`` in a
checkpoint). Shapes: N an image's patches (gh · gw, in merge-block order), D the tower's
width, M the merge size, n = N / M² the image's tokens, d the text model's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from linserve.model.inputs import Insert
from linserve.model.invariant import Linear
from linserve.model.vision.qwen_prep import QwenImageSpec, patches, unpack


@dataclass(frozen=True)
class VisionConfig:
    """A ``vision_config`` of Qwen3.5 (``qwen3_5_vision``)."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    out_hidden: int
    patch: int = 16
    temporal: int = 2
    merge: int = 2
    positions: int = 2304
    theta: float = 10_000.0
    channels: int = 3

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> VisionConfig:
        act = c.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {act!r} is not served")
        rope = c.get("rope_parameters") or {}
        return cls(int(c["depth"]), int(c["hidden_size"]), int(c["intermediate_size"]),
                   int(c["num_heads"]), int(c["out_hidden_size"]), int(c.get("patch_size", 16)),
                   int(c.get("temporal_patch_size", 2)), int(c.get("spatial_merge_size", 2)),
                   int(c.get("num_position_embeddings", 2304)),
                   float(rope.get("rope_theta", 10_000.0)), int(c.get("in_channels", 3)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv3d(cfg.channels, cfg.hidden, (cfg.temporal, cfg.patch, cfg.patch),
                              (cfg.temporal, cfg.patch, cfg.patch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, 3·T·P·P]`` -> ``[N, D]`` (the convolution over one patch is a product)."""
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[N, D]``, cos / sin ``[N, D / heads]`` fp32 -> ``[N, D]``: every patch
        attends every patch of its image."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)
        q, k = (_rotate(y.float(), cos, sin).to(x.dtype) for y in (q, k))
        o = F.scaled_dot_product_attention(q[None].float(), k[None].float(), v[None].float())
        return self.proj(o[0].transpose(0, 1).reshape(n, -1).to(x.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on whole heads, halves rotated: x ``[H, N, Dh]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden, cfg.intermediate)
        self.linear_fc2 = Linear(cfg.intermediate, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        wide = cfg.hidden * cfg.merge ** 2
        self.norm = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.linear_fc1 = Linear(wide, wide)
        self.linear_fc2 = Linear(wide, cfg.out_hidden)
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` -> ``[n, d]``: each M² consecutive patches (a merge block) one token."""
        x = self.norm(x).reshape(-1, self.wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class QwenVisionTower(nn.Module):
    """The tower (see the module docstring)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.positions, cfg.hidden)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = Merger(cfg)
        self.side = int(cfg.positions ** 0.5)

    def _block_order(self, grid: torch.Tensor) -> torch.Tensor:
        """A ``[gh, gw, ...]`` grid's cells in merge-block order -> ``[gh·gw, ...]``."""
        gh, gw, m = grid.shape[0], grid.shape[1], self.cfg.merge
        blocks = grid.reshape(gh // m, m, gw // m, m, *grid.shape[2:]).transpose(1, 2)
        return blocks.reshape(gh * gw, *grid.shape[2:])

    def positions(self, gh: int, gw: int) -> torch.Tensor:
        """The position table resized (bilinear, corners aligned) to ``gh × gw``, in
        merge-block order -> ``[gh·gw, D]`` fp32."""
        table = self.pos_embed.weight.float().T.reshape(1, -1, self.side, self.side)
        grid = F.interpolate(table, size=(gh, gw), mode="bilinear", align_corners=True)
        return self._block_order(grid[0].permute(1, 2, 0))

    def rotary(self, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[gh·gw, Dh]`` fp32 of each patch's (row, column), in merge-block order:
        the first Dh/4 frequencies on the row, the next on the column, the whole repeated."""
        dh = self.cfg.hidden // self.cfg.heads
        spatial = dh // 2
        inv = 1.0 / (self.cfg.theta ** (torch.arange(0, spatial, 2, dtype=torch.float)
                                        / spatial))
        rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        pos = self._block_order(torch.stack([rows, cols], dim=-1))  # [N, 2]
        angles = (pos[..., None].float() * inv).reshape(pos.shape[0], -1)  # [N, Dh/2]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """Patches ``[gh·gw, 3·T·P·P]`` of one image -> its tokens' embeddings ``[n, d]``."""
        dtype = self.pos_embed.weight.dtype
        x = self.patch_embed(pixels.to(dtype)).float() + self.positions(gh, gw)
        x = x.to(dtype)
        cos, sin = self.rotary(gh, gw)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x)


class QwenImageEncoder:
    """The tower as the engine's encoder of ``"image"`` items (:mod:`linserve.model.inputs`):
    a payload from :func:`linserve.model.vision.qwen_prep.prepare` -> ``[n, d]``."""

    def __init__(self, tower: QwenVisionTower, spec: QwenImageSpec) -> None:
        self.tower, self.spec = tower, spec

    def encode(self, item: Insert) -> torch.Tensor:
        values, (gh, gw) = patches(self.spec, unpack(item.payload))
        out = self.tower(torch.from_numpy(np.array(values)), gh, gw)
        if out.shape[0] != item.length:
            raise ValueError(f"the image gives {out.shape[0]} tokens, the prompt holds "
                             f"{item.length}")
        return out
