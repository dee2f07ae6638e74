"""The Qwen-VL image processor (transformers' ``Qwen2VLImageProcessorPil``, which Qwen3-VL
and Qwen3.5 use), pinned to its PIL backend: ``smart_resize`` to multiples of
patch × merge within the pixel limits, a bicubic resize, rescale and normalize, and the
patches in merge-block order. Torch-free: the HTTP process resizes and counts tokens, the
engine normalizes and patchifies (:func:`patches`).

Shapes: P the patch size, M the merge size, T the temporal patch (a still image repeated
T times), an image of gh × gw patches gives gh·gw patches of 3·T·P·P values and
(gh / M) · (gw / M) tokens.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from linserve.model.vision.images import ImageError, RGBImage

HEADER = struct.Struct("<4sII")  # a payload: b"QWI1", width, height, then RGB bytes


@dataclass(frozen=True)
class QwenImageSpec:
    """How a checkpoint's images become tokens: ``placeholder`` the ``<|image_pad|>`` id the
    chat template writes once per image (expanded to the image's tokens), the processor's
    sizes and limits, and its normalization."""

    placeholder: int
    patch: int = 16
    merge: int = 2
    temporal: int = 2
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    kind: str = "qwen"

    @classmethod
    def from_checkpoint(cls, path: Path, config: dict[str, Any]) -> QwenImageSpec:
        """From ``config.json``'s ``image_token_id`` and ``vision_config`` and, where the
        folder has one, ``preprocessor_config.json`` (its ``size`` or ``min_pixels`` /
        ``max_pixels``, ``image_mean`` / ``image_std``)."""
        vision = config.get("vision_config") or {}
        pre: dict[str, Any] = {}
        file = path / "preprocessor_config.json" if path.is_dir() else None
        if file is not None and file.is_file():
            pre = json.loads(file.read_text())
        size = pre.get("size") or {}
        return cls(
            placeholder=int(config["image_token_id"]),
            patch=int(pre.get("patch_size") or vision.get("patch_size", 16)),
            merge=int(pre.get("merge_size") or vision.get("spatial_merge_size", 2)),
            temporal=int(pre.get("temporal_patch_size")
                         or vision.get("temporal_patch_size", 2)),
            min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 65_536),
            max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 16_777_216),
            mean=_three(pre.get("image_mean"), 0.5), std=_three(pre.get("image_std"), 0.5))

    def with_limits(self, overrides: dict[str, Any]) -> QwenImageSpec:
        """The spec with ``min_pixels`` / ``max_pixels`` replaced (``--mm-processor-kwargs``)."""
        known = {k: int(v) for k, v in overrides.items() if k in ("min_pixels", "max_pixels")}
        return QwenImageSpec(**{**self.__dict__, **known})


def _three(value: Any, default: float) -> tuple[float, float, float]:
    if value is None:
        return (default, default, default)
    v = [float(x) for x in (value if isinstance(value, list) else [value] * 3)]
    return (v[0], v[1], v[2])


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """transformers' ``smart_resize``: both sides multiples of ``factor``, the area within
    [min_pixels, max_pixels], the aspect ratio kept as nearly as it can be."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image's aspect ratio is over 200 ({width}×{height})")
    return fit_area(height, width, factor, min_pixels, max_pixels)


def fit_area(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
             at_least_one: bool = False) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor``, then scaled (aspect kept) into
    [min_pixels, max_pixels]; ``at_least_one``: the rounding never gives 0 (LFM2-VL's)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if at_least_one:
        h_bar, w_bar = max(factor, h_bar), max(factor, w_bar)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenImage:
    """An image resized for the tower: ``grid`` its tokens as (rows, columns) after the
    merge; ``payload`` what the engine's tower reads (:func:`unpack`)."""

    grid: tuple[int, int]
    payload: bytes

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def prepare(spec: QwenImageSpec, image: RGBImage, max_pixels: int | None = None) -> QwenImage:
    """Resize ``image`` as the processor does (bicubic, on the 8-bit pixels), within
    ``max_pixels`` where given (a request's ``detail``), else the spec's limit."""
    factor = spec.patch * spec.merge
    limit = spec.max_pixels if max_pixels is None else min(max_pixels, spec.max_pixels)
    h, w = smart_resize(image.height, image.width, factor, min(spec.min_pixels, limit), limit)
    resized = image.pil().resize((w, h), resample=Image.Resampling.BICUBIC)
    payload = HEADER.pack(b"QWI1", w, h) + resized.tobytes()
    return QwenImage((h // factor, w // factor), payload)


def unpack(payload: bytes) -> np.ndarray:
    """A :func:`prepare` payload -> its pixels ``[H, W, 3]`` uint8 (ImageError if it is
    not one)."""
    if len(payload) < HEADER.size:
        raise ImageError("an image payload is truncated")
    magic, w, h = HEADER.unpack_from(payload)
    if magic != b"QWI1" or len(payload) != HEADER.size + 3 * w * h:
        raise ImageError("an image payload is malformed")
    return np.frombuffer(payload, np.uint8, offset=HEADER.size).reshape(h, w, 3)


def patches(spec: QwenImageSpec, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    """Pixels ``[H, W, 3]`` uint8 (already resized) -> rescaled, normalized patches
    ``[gh·gw, 3·T·P·P]`` fp32 in merge-block order and the patch grid (gh, gw), as
    transformers' processor makes ``pixel_values`` and ``image_grid_thw``."""
    scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    normed = (scaled - np.array(spec.mean, np.float32)) / np.array(spec.std, np.float32)
    x = np.ascontiguousarray(normed.astype(np.float32).transpose(2, 0, 1))  # [3, H, W]
    p, m, t = spec.patch, spec.merge, spec.temporal
    gh, gw = x.shape[1] // p, x.shape[2] // p
    blocks = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(blocks.reshape(gh * gw, 3 * t * p * p)), (gh, gw)
