"""The LFM2-VL image processor's layout (transformers' ``Lfm2VlImageProcessor`` and
``Lfm2VlProcessor``), torch-free: how an image becomes tokens. A small image is resized
whole (``smart_resize``: multiples of patch × downsample, between ``min_image_tokens`` and
``max_image_tokens``); one over ``max_image_tokens`` × ``max_pixels_tolerance`` is cut into
a grid of 512-pixel tiles (between ``min_tiles`` and ``max_tiles``, the grid closest to its
aspect ratio) plus a thumbnail of the whole. Its tokens: ``<|image_start|>``, each tile's
``<|img_row_R_col_C|>`` and 256 image tokens, ``<|img_thumbnail|>`` and the thumbnail's, then
``<|image_end|>``; a single image is its own tokens between start and end.

The HTTP process counts them from the image's size alone (:func:`layout`); the engine's
encoder (:mod:`.siglip2_tower`) makes the pixels (a bilinear, antialiased resize of the
8-bit image, as torchvision's; rescale and normalize) and the tiles' features, and gives the
marker tokens their embeddings. Shapes: P the encoder's patch, f the downsample factor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linserve.model.vision.images import ImageError, RGBImage
from linserve.model.vision.qwen_prep import fit_area

HEADER = struct.Struct("<4sII")  # a payload: b"LFI1", width, height, then RGB bytes
MARKERS = ("<|image_start|>", "<|image_end|>", "<|img_thumbnail|>")


@dataclass(frozen=True)
class Lfm2ImageSpec:
    """How a checkpoint's images become tokens (``preprocessor_config.json``'s fields and
    the marker tokens' ids; ``markers`` maps each marker's text to its id)."""

    placeholder: int  # <image>
    markers: dict[str, int] = field(default_factory=dict, repr=False)
    patch: int = 16
    downsample: int = 2
    min_image_tokens: int = 64
    max_image_tokens: int = 256
    min_tiles: int = 2
    max_tiles: int = 10
    tile_size: int = 512
    use_thumbnail: bool = True
    splitting: bool = True
    tolerance: float = 2.0
    special_tokens: bool = True
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    kind: str = "lfm2"

    @classmethod
    def from_checkpoint(cls, path: Path, config: dict[str, Any]) -> Lfm2ImageSpec:
        """From ``config.json`` (``image_token_id``), ``preprocessor_config.json`` and the
        markers' ids in ``tokenizer.json``."""
        pre = _json(path / "preprocessor_config.json")
        added = {t["content"]: int(t["id"])
                 for t in _json(path / "tokenizer.json").get("added_tokens", [])}
        wanted = [*MARKERS, *(f"<|img_row_{r}_col_{c}|>" for r in range(1, 11)
                              for c in range(1, 11))]
        spec = cls(placeholder=int(config.get("image_token_id", 396)),
                   markers={m: added[m] for m in wanted if m in added})
        known = {"encoder_patch_size": "patch", "downsample_factor": "downsample",
                 "min_image_tokens": "min_image_tokens", "max_image_tokens": "max_image_tokens",
                 "min_tiles": "min_tiles", "max_tiles": "max_tiles", "tile_size": "tile_size",
                 "use_thumbnail": "use_thumbnail", "do_image_splitting": "splitting",
                 "max_pixels_tolerance": "tolerance"}
        fields = {ours: type(getattr(spec, ours))(pre[theirs]) for theirs, ours in known.items()
                  if theirs in pre}
        for key, ours in (("image_mean", "mean"), ("image_std", "std")):
            if key in pre:
                v = [float(x) for x in pre[key]]
                fields[ours] = (v[0], v[1], v[2])
        fields["downsample"] = int(config.get("downsample_factor", fields.get("downsample", 2)))
        return Lfm2ImageSpec(**{**spec.__dict__, **fields})

    def with_limits(self, overrides: dict[str, Any]) -> Lfm2ImageSpec:
        """The spec with processor fields replaced (``--mm-processor-kwargs``: its
        ``min_image_tokens``, ``max_image_tokens``, ``min_tiles``, ``max_tiles``)."""
        known = ("min_image_tokens", "max_image_tokens", "min_tiles", "max_tiles")
        return Lfm2ImageSpec(**{**self.__dict__,
                                **{k: int(v) for k, v in overrides.items() if k in known}})


def _json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def smart_resize(spec: Lfm2ImageSpec, height: int, width: int) -> tuple[int, int]:
    """The whole image's (or the thumbnail's) size: (height, width)."""
    factor = spec.patch * spec.downsample
    per_token = spec.patch ** 2 * spec.downsample ** 2
    return fit_area(height, width, factor, spec.min_image_tokens * per_token,
                    spec.max_image_tokens * per_token, at_least_one=True)


def too_large(spec: Lfm2ImageSpec, height: int, width: int) -> bool:
    factor = spec.patch * spec.downsample
    h_bar = max(spec.patch, round_by_factor(height, factor))
    w_bar = max(spec.patch, round_by_factor(width, factor))
    return h_bar * w_bar > (spec.max_image_tokens * spec.patch ** 2 * spec.downsample ** 2
                            * spec.tolerance)


def target_ratios(lo: int, hi: int) -> list[tuple[int, int]]:
    ratios = {(w, h) for n in range(lo, hi + 1) for w in range(1, n + 1)
              for h in range(1, n + 1) if lo <= w * h <= hi}
    return sorted(ratios, key=lambda r: r[0] * r[1])


def grid(spec: Lfm2ImageSpec, height: int, width: int) -> tuple[int, int]:
    """The tile grid of a large image: (columns, rows), the aspect ratio closest to the
    image's (ties: the larger grid where the image covers half its area)."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for ratio in target_ratios(spec.min_tiles, spec.max_tiles):
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and area > 0.5 * spec.tile_size ** 2 * ratio[0] * ratio[1]:
            best = ratio
    return best


@dataclass(frozen=True)
class Layout:
    """An image's pieces: ``rows × cols`` tiles of ``tile_size`` (1 × 1: none, the image
    whole) and the whole (or thumbnail) at ``size`` (height, width); ``sequence`` its
    tokens: a marker's id, or -n for n image tokens of the next piece."""

    rows: int
    cols: int
    size: tuple[int, int]
    sequence: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(-t if t < 0 else 1 for t in self.sequence)

    @property
    def tiled(self) -> bool:
        return self.rows > 1 or self.cols > 1


def layout(spec: Lfm2ImageSpec, height: int, width: int) -> Layout:
    """How an image of ``height × width`` pixels is cut and what tokens it becomes."""
    size = smart_resize(spec, height, width)
    splitting = spec.splitting and not spec.min_tiles == spec.max_tiles == 1
    cols, rows = grid(spec, height, width) if splitting and too_large(spec, height, width) \
        else (1, 1)
    per = lambda n: math.ceil((n // spec.patch) / spec.downsample)  # noqa: E731
    whole = per(size[0]) * per(size[1])
    tile = math.ceil((spec.tile_size // spec.patch) / spec.downsample) ** 2
    seq: list[int] = []
    mark = (lambda text: seq.append(_marker(spec, text))) if spec.special_tokens \
        else (lambda text: None)
    mark("<|image_start|>")
    if rows > 1 or cols > 1:
        for r in range(rows):
            for c in range(cols):
                mark(f"<|img_row_{r + 1}_col_{c + 1}|>")
                seq.append(-tile)
        if spec.use_thumbnail:
            mark("<|img_thumbnail|>")
            seq.append(-whole)
    else:
        seq.append(-whole)
    mark("<|image_end|>")
    return Layout(rows, cols, size, tuple(seq))


def _marker(spec: Lfm2ImageSpec, text: str) -> int:
    if text not in spec.markers:
        raise ImageError(f"the tokenizer has no {text} token for this image's layout")
    return spec.markers[text]


def prepare(spec: Lfm2ImageSpec, image: RGBImage) -> tuple[int, bytes]:
    """The image's token count and the payload its encoder reads (its pixels)."""
    return layout(spec, image.height, image.width).tokens, \
        HEADER.pack(b"LFI1", image.width, image.height) + image.pixels


def unpack(payload: bytes) -> RGBImage:
    if len(payload) < HEADER.size:
        raise ImageError("an image payload is truncated")
    magic, w, h = HEADER.unpack_from(payload)
    if magic != b"LFI1" or len(payload) != HEADER.size + 3 * w * h:
        raise ImageError("an image payload is malformed")
    return RGBImage(w, h, payload[HEADER.size:])
