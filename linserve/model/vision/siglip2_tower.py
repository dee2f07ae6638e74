"""LFM2-VL's vision side: a SigLIP2 NaFlex encoder (patches of any grid: a linear patch
embedding plus a learned square position table resized, bilinear and antialiased, to the
grid; pre-norm ViT layers; a final LayerNorm) and the projector (pixel unshuffle by f,
LayerNorm, Linear, GELU, Linear) to the text model's width.

Parameter names follow transformers' ``Siglip2VisionModel`` (``model.vision_tower.*``) and
``Lfm2VlMultiModalProjector`` (``model.multi_modal_projector.*``). Each tile (or the whole
image, or its thumbnail) is encoded alone, so no padding or attention mask is needed.
Shapes: h × w patches, D the encoder's width, d the text model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from linserve.model.inputs import Insert
from linserve.model.invariant import Linear
from linserve.model.vision.lfm2_prep import Layout, Lfm2ImageSpec, layout, unpack


@dataclass(frozen=True)
class SiglipConfig:
    """A ``siglip2_vision_model`` config and LFM2-VL's projector fields."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    patch: int
    positions: int
    eps: float
    text_hidden: int
    projector_hidden: int
    downsample: int
    projector_norm: bool = True
    projector_bias: bool = True

    @classmethod
    def from_hf(cls, c: dict[str, Any], text_hidden: int) -> SiglipConfig:
        v = c["vision_config"]
        for key, want in (("hidden_act", "gelu_pytorch_tanh"),):
            if v.get(key, want) != want:
                raise ValueError(f"vision_config.{key} {v.get(key)!r} is not served")
        if c.get("projector_hidden_act", "gelu") != "gelu":
            raise ValueError(f"projector_hidden_act {c.get('projector_hidden_act')!r} is not "
                             f"served")
        if v.get("vision_use_head"):
            raise ValueError("vision_config.vision_use_head is not served (LFM2-VL has none)")
        return cls(int(v["hidden_size"]), int(v["intermediate_size"]),
                   int(v["num_hidden_layers"]), int(v["num_attention_heads"]),
                   int(v.get("patch_size", 16)), int(v.get("num_patches", 256)),
                   float(v.get("layer_norm_eps", 1e-6)), text_hidden,
                   int(c.get("projector_hidden_size", 2560)), int(c.get("downsample_factor", 2)),
                   bool(c.get("projector_use_layernorm", True)),
                   bool(c.get("projector_bias", True)))


class Embeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = Linear(3 * cfg.patch ** 2, cfg.hidden)
        self.position_embedding = nn.Embedding(cfg.positions, cfg.hidden)
        self.side = int(cfg.positions ** 0.5)

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """``[h·w, 3·P·P]`` (row-major patches) -> ``[h·w, D]``."""
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))
        table = self.position_embedding.weight.float().reshape(self.side, self.side, -1)
        grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                             align_corners=False, antialias=True)
        return x + grid[0].reshape(-1, h * w).T.to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            Linear(cfg.hidden, cfg.hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).reshape(n, self.heads, -1).transpose(0, 1).float()
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        return self.out_proj(o.transpose(0, 1).reshape(n, -1).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden, cfg.intermediate)
        self.fc2 = Linear(cfg.intermediate, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.self_attn = SelfAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.layers)])


class SiglipTower(nn.Module):
    """``Siglip2VisionModel`` without its pooling head."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = self.embeddings(patches, h, w)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Projector(nn.Module):
    """``Lfm2VlMultiModalProjector``."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        wide = cfg.hidden * cfg.downsample ** 2
        self.factor = cfg.downsample
        self.layer_norm = nn.LayerNorm(wide) if cfg.projector_norm else None
        self.linear_1 = Linear(wide, cfg.projector_hidden, bias=cfg.projector_bias)
        self.linear_2 = Linear(cfg.projector_hidden, cfg.text_hidden, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Features ``[h·w, D]`` -> tokens ``[(h/f)·(w/f), d]`` (transformers' unshuffle)."""
        f, c = self.factor, x.shape[-1]
        y = x.reshape(1, h, w // f, c * f).permute(0, 2, 1, 3)
        y = y.reshape(1, w // f, h // f, c * f * f).permute(0, 2, 1, 3)
        if self.layer_norm is not None:
            y = self.layer_norm(y)
        y = self.linear_2(F.gelu(self.linear_1(y)))
        return y.reshape(-1, y.shape[-1])


def resized(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[3, H, W]`` uint8 -> ``[3, height, width]`` uint8: bilinear, antialiased, on the
    8-bit values, as torchvision resizes a uint8 image."""
    return F.interpolate(pixels[None], size=(height, width), mode="bilinear",
                         align_corners=False, antialias=True)[0]


def patches_of(spec: Lfm2ImageSpec, image: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``[3, H, W]`` uint8 -> normalized patches ``[h·w, P·P·3]`` fp32 (row-major; each
    patch's pixels row-major, channels last) and (h, w)."""
    mean = torch.tensor(spec.mean) * 255.0
    std = torch.tensor(spec.std) * 255.0
    x = (image.float() - mean[:, None, None]) / std[:, None, None]
    p = spec.patch
    h, w = x.shape[1] // p, x.shape[2] // p
    out = x.reshape(3, h, p, w, p).permute(1, 3, 2, 4, 0).reshape(h * w, -1)
    return out, h, w


def pieces(spec: Lfm2ImageSpec, pixels: torch.Tensor, lay: Layout) -> list[torch.Tensor]:
    """The image ``[3, H, W]`` uint8 cut as ``lay`` says: its tiles (row-major) and its
    thumbnail, or the whole, each ``[3, h, w]`` uint8."""
    if not lay.tiled:
        return [resized(pixels, *lay.size)]
    t = spec.tile_size
    big = resized(pixels, t * lay.rows, t * lay.cols)
    tiles = [big[:, r * t:(r + 1) * t, c * t:(c + 1) * t]
             for r in range(lay.rows) for c in range(lay.cols)]
    return tiles + ([resized(pixels, *lay.size)] if spec.use_thumbnail else [])


class Lfm2ImageEncoder:
    """The tower and projector as the engine's encoder of ``"image"`` items: the item's rows
    are its whole token sequence, the markers' rows from the text model's embeddings
    (``embed``: ids ``[n]`` -> ``[n, d]``), the image tokens' from the pieces' features."""

    def __init__(self, tower: SiglipTower, projector: Projector, spec: Lfm2ImageSpec,
                 embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.tower, self.projector, self.spec, self.embed = tower, projector, spec, embed

    @torch.inference_mode()
    def features(self, piece: torch.Tensor) -> torch.Tensor:
        """One piece ``[3, h, w]`` uint8 -> its tokens' embeddings ``[n, d]``."""
        values, h, w = patches_of(self.spec, piece)
        return self.projector(self.tower(values, h, w), h, w)

    @torch.inference_mode()
    def encode(self, item: Insert) -> torch.Tensor:
        image = unpack(item.payload)
        lay = layout(self.spec, image.height, image.width)
        arr = np.frombuffer(image.pixels, np.uint8).reshape(image.height, image.width, 3)
        pixels = torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()
        feats = iter(self.features(p) for p in pieces(self.spec, pixels, lay))
        rows: list[torch.Tensor] = []
        for t in lay.sequence:
            rows.append(next(feats) if t < 0 else self.embed(torch.tensor([t])))
        out = torch.cat([r.to(rows[0].dtype) for r in rows])
        if out.shape[0] != item.length:
            raise ValueError(f"the image gives {out.shape[0]} tokens, the prompt holds "
                             f"{item.length}")
        return out
