"""An image as a request sends it: bytes decoded by Pillow into RGB pixels, checked on the
way (a corrupt or truncated file, a format that is not an image, one over the pixel cap).

Transparency is composited onto white, as transformers' ``convert_to_rgb`` does; an
animated GIF or WebP gives its first frame. Torch-free (the HTTP process runs it).
"""

from __future__ import annotations

import hashlib
import io
import struct
import warnings
from dataclasses import dataclass

from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what is decoded; anything else is refused
MAX_PIXELS = 64_000_000  # a decoded image's largest area (width × height), by default


class ImageError(ValueError):
    """An image that cannot be used: the message says why, for a 400."""


@dataclass(frozen=True)
class RGBImage:
    """Decoded pixels: ``pixels`` ``height × width × 3`` bytes, row-major."""

    width: int
    height: int
    pixels: bytes

    def pil(self) -> Image.Image:
        return Image.frombytes("RGB", (self.width, self.height), self.pixels)


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> RGBImage:
    """``data`` (PNG, JPEG, WebP or GIF) -> its RGB pixels (ImageError if it is none of
    those, is corrupt or truncated, or has more than ``max_pixels`` pixels)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(FORMATS))
            w, h = img.size
            if w * h > max_pixels:
                raise ImageError(f"the image is {w}×{h} pixels, more than the limit of "
                                 f"{max_pixels:,}")
            img.seek(0)  # an animation's first frame
            img.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(f"the image is too large to decode: {exc}") from None
    except Image.UnidentifiedImageError:
        raise ImageError("the data is not a PNG, JPEG, WebP or GIF image") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the image is corrupt or truncated ({exc})") from None
    if w < 1 or h < 1:
        raise ImageError("the image has no pixels")
    return RGBImage(w, h, to_rgb(img).tobytes())


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as RGB, transparency composited onto white (transformers' way)."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def digest(image: RGBImage, *salt: bytes) -> str:
    """The content hash of an image's pixels (and its size, and ``salt``: how it was
    prepared), as :class:`linserve.model.inputs.Insert` carries it (hex)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<II", image.width, image.height))
    h.update(image.pixels)
    for s in salt:
        h.update(s)
    return h.hexdigest()
