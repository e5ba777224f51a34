"""Turn the image URLs of a chat request into RGB PIL images, safely.

`data:image/...;base64,...` URLs are decoded in the replica. Remote `http(s)://` URLs are refused unless they start
with a prefix in `engine.image_url_allowlist`; allowed ones are fetched with a time limit, without following
redirects (which could leave the allow-list), and with the size capped while the body streams in. Every problem is
an `InvalidRequestError` (HTTP 400) on `messages`, since the client sent the URL.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io

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
    if not any(url.startswith(prefix) for prefix in allowlist):
        raise InvalidRequestError(
            "remote image URLs are disabled; allow-list a prefix in engine.image_url_allowlist "
            "or send the image as a base64 data URL",
            param=_PARAM,
        )


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
