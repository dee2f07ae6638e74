"""Where an image part's bytes come from: a ``data:`` URL (always), an ``http(s)`` URL of a
host in ``--allowed-media-domains`` (fetched with a timeout and a size cap, redirects not
followed, so the allow-list holds), or a ``file://`` URL under
``--allowed-local-media-path`` (vLLM's flags). Anything else is a 400 that says which."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from linserve.server.api.errors import APIError
from linserve.server.settings import Settings


def _refused(message: str, param: str) -> APIError:
    return APIError(400, message, param, "invalid_image_url")


def data_url(url: str, limit: int, param: str) -> bytes:
    """The bytes of ``data:[type][;base64],DATA``."""
    head, sep, body = url.partition(",")
    if not sep:
        raise _refused("a data: URL needs a comma before its data", param)
    if len(body) > limit * 4 // 3 + 4:
        raise APIError(400, f"the image is larger than {limit:,} bytes", param,
                       "image_too_large")
    if head.endswith(";base64"):
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise _refused("a data: URL's base64 data is not valid base64", param) from None
    return unquote(body).encode("latin-1", "replace")


async def fetch(url: str, settings: Settings, param: str) -> bytes:
    """An image part's URL -> its bytes (400 for one that is refused, fails, times out or
    is larger than ``--media-max-bytes``)."""
    limit = settings.media_max_bytes
    if url.startswith("data:"):
        return data_url(url, limit, param)
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        return await _http(url, parts.hostname or "", settings, param)
    if parts.scheme == "file":
        return _local(unquote(parts.path), settings, param)
    raise _refused(f"image URLs are data:, http(s): or file: URLs, not {url[:40]!r}", param)


async def _http(url: str, host: str, settings: Settings, param: str) -> bytes:
    allowed = {h.strip().lower() for h in settings.allowed_media_domains.split(",") if h.strip()}
    if host.lower() not in allowed:
        raise _refused(f"image URLs of host {host!r} are not fetched (the server fetches "
                       f"those of --allowed-media-domains only; send the image as a data: "
                       f"URL)", param)
    limit = settings.media_max_bytes
    try:
        async with httpx.AsyncClient(timeout=settings.media_fetch_timeout,
                                     follow_redirects=False) as client, \
                client.stream("GET", url) as reply:
            if reply.status_code != 200:
                raise _refused(f"fetching the image gave HTTP {reply.status_code}", param)
            data = bytearray()
            async for chunk in reply.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    raise APIError(400, f"the image is larger than {limit:,} bytes",
                                   param, "image_too_large")
            return bytes(data)
    except httpx.TimeoutException:
        raise _refused(f"fetching the image took longer than {settings.media_fetch_timeout:g} "
                       f"s", param) from None
    except httpx.HTTPError as exc:
        raise _refused(f"the image could not be fetched: {exc}", param) from None


def _local(path: str, settings: Settings, param: str) -> bytes:
    root = settings.allowed_local_media_path
    if not root:
        raise _refused("file: image URLs are not read (see --allowed-local-media-path)", param)
    base, target = Path(root).resolve(), Path(path).resolve()
    if not target.is_relative_to(base) or not target.is_file():
        raise _refused(f"no image file {path!r} under the allowed media path", param)
    if target.stat().st_size > settings.media_max_bytes:
        raise APIError(400, f"the image is larger than {settings.media_max_bytes:,} bytes",
                       param, "image_too_large")
    return target.read_bytes()
