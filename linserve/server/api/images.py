"""A chat's images, from its messages' parts to the prompt's items: each image part read
(:mod:`.media`), decoded and checked (:mod:`linserve.model.vision.images`), resized as the
checkpoint's processor does (the spec in ``info.image_spec``), and put where the chat
template wrote its placeholder, expanded to the image's tokens as virtual ids
(:mod:`linserve.model.inputs`): the prefix cache, sessions and transcripts then tell two
images apart by their pixels. Nothing is dropped: a part that cannot be used is a 400."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from linserve.model.inputs import Insert, mark
from linserve.model.vision import images as decoding
from linserve.model.vision.prepare import prepare_image
from linserve.server.api.errors import APIError
from linserve.server.api.media import fetch
from linserve.server.api.protocol import IMAGE_PARTS, ChatMessage
from linserve.server.settings import Settings

LOW_DETAIL_PIXELS = 512 * 512  # OpenAI's "detail": "low": at most this many pixels


@dataclass(frozen=True)
class PromptImage:
    """One image as the prompt holds it: its tokens' grid, what the tower reads, and the
    hash of its pixels and preparation."""

    grid: tuple[int, int]
    payload: bytes
    digest: str

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def image_parts(messages: list[ChatMessage]) -> list[tuple[int, dict[str, Any]]]:
    """Every image part, in order, with its message's index."""
    return [(i, part) for i, m in enumerate(messages) if isinstance(m.content, list)
            for part in m.content if isinstance(part, dict) and part.get("type") in IMAGE_PARTS]


def part_url(part: dict[str, Any]) -> tuple[str, str]:
    """An image part's URL and detail, in any API's shape (chat's ``image_url`` object or
    string, the Responses API's ``image_url`` string, Anthropic's ``source``)."""
    ref = part.get("image_url")
    if isinstance(ref, dict):
        return str(ref.get("url") or ""), str(ref.get("detail") or "auto")
    if isinstance(ref, str):
        return ref, str(part.get("detail") or "auto")
    source = part.get("source")
    if isinstance(source, dict):
        if source.get("type") == "base64":
            return f"data:{source.get('media_type', '')};base64,{source.get('data', '')}", "auto"
        return str(source.get("url") or ""), "auto"
    return "", "auto"


async def read_images(messages: list[ChatMessage], spec: Any, settings: Settings
                      ) -> list[PromptImage]:
    """Every image of ``messages``, read and prepared (400 for one that cannot be)."""
    parts = image_parts(messages)
    if len(parts) > settings.image_limit:
        raise APIError(400, f"the request holds {len(parts)} images, more than this server's "
                       f"limit of {settings.image_limit} a prompt (--limit-mm-per-prompt)",
                       "messages", "too_many_images")
    out = []
    for i, part in parts:
        param = f"messages[{i}].content"
        url, detail = part_url(part)
        if not url:
            raise APIError(400, "an image part has no URL or data", param, "invalid_image_url")
        data = await fetch(url, settings, param)
        out.append(await asyncio.to_thread(_prepare, data, spec, detail, param))
    return out


def _prepare(data: bytes, spec: Any, detail: str, param: str) -> PromptImage:
    try:
        rgb = decoding.decode(data)
        limit = LOW_DETAIL_PIXELS if detail == "low" else None
        grid, payload = prepare_image(spec, rgb, limit)
    except decoding.ImageError as exc:
        raise APIError(400, f"{param}: {exc}", param, "invalid_image") from None
    return PromptImage(grid, payload, decoding.digest(rgb, repr(spec).encode(),
                                                      str(limit).encode()))


def place(ids: list[int], placeholder: int, found: list[PromptImage]
          ) -> tuple[list[int], tuple[Insert, ...]]:
    """``ids`` with each ``placeholder`` the template wrote expanded to its image's tokens
    (virtual ids) -> the prompt and its items (400 where the placeholders and the images do
    not match one for one)."""
    at = [i for i, t in enumerate(ids) if t == placeholder]
    if len(at) != len(found):
        raise APIError(400, f"the prompt has {len(at)} image placeholders for {len(found)} "
                       f"images (the chat template places one per image part; a placeholder "
                       f"token in the text is not allowed)", "messages", "invalid_messages")
    out: list[int] = []
    inserts: list[Insert] = []
    last = 0
    for pos, image in zip(at, found, strict=True):
        out += ids[last:pos]
        inserts.append(Insert("image", len(out), image.tokens, image.digest, image.payload,
                              image.grid))
        out += [placeholder] * image.tokens
        last = pos + 1
    out += ids[last:]
    return mark(out, inserts), tuple(inserts)
