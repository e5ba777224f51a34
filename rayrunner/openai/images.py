"""Turn the image URLs of a chat request into RGB PIL images, safely.

`data:image/...;base64,...` URLs are decoded in the replica. Remote `http(s)://` URLs are refused unless an entry of
`engine.image_url_allowlist` admits them: the same scheme, host (case-insensitive) and port (the scheme's default when
the entry names none), and a path that starts with the entry's path segments, whole segments only. URLs with user
info, or with dot or encoded-slash segments, are refused. Allowed ones are fetched with a time limit, without
following redirects (which could leave the allow-list), and with the size capped while the body streams in. Every
problem is an `InvalidRequestError` (HTTP 400) on `messages`, since the client sent the URL.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from urllib.parse import unquote

import httpx
from PIL import Image

from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import EngineSettings

_PARAM = "messages"


async def load_images(urls: list[str], settings: EngineSettings) -> list[Image.Image]:
    """One RGB image per URL, in order."""
    return [await load_image(url, settings) for url in urls]


async def load_image(url: str, settings: EngineSettings) -> Image.Image:
    """One URL as an RGB image; decoding runs off the event loop (large PNGs take a while)."""
    data = await _image_bytes(url, settings)
    return await asyncio.to_thread(_decode, data)


async def _image_bytes(url: str, settings: EngineSettings) -> bytes:
    if url.startswith("data:"):
        return _from_data_url(url, settings.max_image_bytes)
    if url.startswith(("http://", "https://")):
        _check_allowed(url, settings.image_url_allowlist)
        return await _fetch(url, settings)
    scheme = url.split(":", 1)[0] if ":" in url else url[:20]
    raise InvalidRequestError(
        f"unsupported image URL scheme `{scheme}`: use a `data:image/...;base64,` URL", param=_PARAM
    )


def _from_data_url(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise InvalidRequestError("image data URLs must look like `data:image/<type>;base64,<data>`", param=_PARAM)
    # Checked before decoding so an oversize payload is never held twice.
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise _too_large(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image data URL is not valid base64", param=_PARAM) from None
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def _check_allowed(url: str, allowlist: list[str]) -> None:
    target = _parsed(url)
    if target is None:
        raise InvalidRequestError(f"image URL `{url}` is not a valid http(s) URL with a host", param=_PARAM)
    if target.userinfo:  # not echoed: it may hold a password
        raise InvalidRequestError("image URLs may not carry user info (`user@host`)", param=_PARAM)
    segments = _segments(target)
    if segments is None:
        raise InvalidRequestError(f"image URL `{url}` has a dot or encoded-slash path segment", param=_PARAM)
    if not any(_admits(entry, target, segments) for entry in allowlist):
        raise InvalidRequestError(
            "remote image URLs are disabled; allow-list a URL prefix in engine.image_url_allowlist "
            "or send the image as a base64 data URL",
            param=_PARAM,
        )


def _parsed(url: str) -> httpx.URL | None:
    """`url` as httpx (which fetches it) reads it; None when it is not an http(s) URL with a host."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return None
    return parsed if parsed.scheme in ("http", "https") and parsed.host else None


def _segments(url: httpx.URL) -> list[str] | None:
    """The decoded segments of `url`'s path, without empty ones; None when one of them is `.` or `..` or holds a
    slash once decoded (a server could resolve those outside the prefix)."""
    raw = url.raw_path.split(b"?", 1)[0].decode("latin-1")  # percent-encoded by httpx: ASCII
    segments = [unquote(segment) for segment in raw.split("/") if segment]
    if any(segment in (".", "..") or "/" in segment or "\\" in segment for segment in segments):
        return None
    return segments


def _admits(entry: str, target: httpx.URL, segments: list[str]) -> bool:
    """Whether the allow-list `entry` admits `target`: same scheme, host and port, and a path under the entry's."""
    allowed = _parsed(entry)
    if allowed is None or allowed.userinfo:
        return False
    prefix = _segments(allowed)
    same_origin = (allowed.scheme, allowed.host, allowed.port) == (target.scheme, target.host, target.port)
    return same_origin and prefix is not None and segments[: len(prefix)] == prefix


async def _fetch(url: str, settings: EngineSettings) -> bytes:
    timeout = settings.image_fetch_timeout_s
    try:
        # httpx's timeout applies per network operation; asyncio.timeout bounds the whole fetch.
        async with asyncio.timeout(timeout), httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
            return await _download(client, url, settings.max_image_bytes)
    except (TimeoutError, httpx.TimeoutException):
        raise InvalidRequestError(f"fetching image `{url}` timed out after {timeout:g} s", param=_PARAM) from None
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"could not fetch image `{url}`: {type(exc).__name__}", param=_PARAM) from None


async def _download(client: httpx.AsyncClient, url: str, max_bytes: int) -> bytes:
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise InvalidRequestError(f"fetching image `{url}` failed: HTTP {response.status_code}", param=_PARAM)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise _too_large(max_bytes)
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise _too_large(max_bytes)
        return bytes(body)


def _decode(data: bytes) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (OSError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"image could not be decoded: {exc}", param=_PARAM) from None


def _too_large(max_bytes: int) -> InvalidRequestError:
    return InvalidRequestError(f"image is larger than the {max_bytes}-byte limit", param=_PARAM)
