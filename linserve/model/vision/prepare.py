"""One entry for the HTTP process: an image prepared by its checkpoint's processor
(``info.image_spec``'s ``kind``), torch-free: its tokens' grid and the payload its encoder
reads."""

from __future__ import annotations

from typing import Any

from linserve.model.vision import lfm2_prep, qwen_prep
from linserve.model.vision.images import RGBImage


def prepare_image(spec: Any, image: RGBImage, max_pixels: int | None = None
                  ) -> tuple[tuple[int, int], bytes]:
    """(rows, columns) of the image's tokens (1 × n where positions are 1-D) and its
    payload. ``max_pixels``: a request's cap (``detail: "low"``), where the processor
    resizes to a pixel budget."""
    if spec.kind == "qwen":
        prepared = qwen_prep.prepare(spec, image, max_pixels)
        return prepared.grid, prepared.payload
    if spec.kind == "lfm2":
        tokens, payload = lfm2_prep.prepare(spec, image)
        return (1, tokens), payload
    raise ValueError(f"images of kind {spec.kind!r} are not prepared here")
