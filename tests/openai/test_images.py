"""Image URL handling: data URLs, limits, refused schemes, the allow-list's matching (scheme, host, port, whole path
segments; no user info), and allow-listed fetches from a local HTTP server."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import EngineSettings
from rayrunner.openai.images import _check_allowed, load_image, load_images
from tests.tiny_models import image_data_url


def _png(color: tuple[int, ...], mode: str = "RGB", size: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (size, size), color).save(buffer, "PNG")
    return buffer.getvalue()


PNG = _png((255, 0, 0))


class _Handler(BaseHTTPRequestHandler):
    """`/red.png`; `/stream` (a large body with no Content-Length); `/slow`; anything else 404."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/red.png":
            self._reply(PNG, length=True)
        elif self.path == "/stream":
            self._reply(b"\0" * 50_000, length=False)
        elif self.path == "/slow":
            time.sleep(1.0)
            self._reply(PNG, length=True)
        else:
            self.send_error(404)

    def _reply(self, body: bytes, length: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client of `/slow` has gone by the time it answers: a broken pipe is expected


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _QuietServer(("127.0.0.1", 0), _Handler)
    httpd.protocol_version = "HTTP/1.0"  # a body without Content-Length ends when the connection closes
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    thread.join()


async def _refused(url: str, settings: EngineSettings, match: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        await load_image(url, settings)
    assert info.value.param == "messages"
    return info.value


async def test_data_url_decodes_to_rgb() -> None:
    images = await load_images(
        [image_data_url(Image.new("RGBA", (8, 6), (0, 0, 255, 128))), image_data_url(Image.new("L", (4, 4)))],
        EngineSettings(),
    )
    assert [(im.mode, im.size) for im in images] == [("RGB", (8, 6)), ("RGB", (4, 4))]


async def test_jpeg_data_url() -> None:
    image = await load_image(image_data_url(Image.new("RGB", (16, 16), (0, 200, 0)), "JPEG"), EngineSettings())
    assert image.size == (16, 16)


async def test_bad_base64_is_refused() -> None:
    await _refused("data:image/png;base64,not*base64!", EngineSettings(), "not valid base64")


async def test_bytes_that_are_not_an_image_are_refused() -> None:
    url = "data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode()
    await _refused(url, EngineSettings(), "could not be decoded")


@pytest.mark.parametrize("url", ["data:text/plain;base64,aGk=", "data:image/png,rawbytes", "data:image/png;base64"])
async def test_malformed_data_url_is_refused(url: str) -> None:
    await _refused(url, EngineSettings(), "data:image/<type>;base64")


async def test_oversize_data_url_is_refused() -> None:
    settings = EngineSettings(max_image_bytes=len(PNG) - 1)
    await _refused("data:image/png;base64," + base64.b64encode(PNG).decode(), settings, "larger than")
    settings = EngineSettings(max_image_bytes=len(PNG))
    assert (await load_image("data:image/png;base64," + base64.b64encode(PNG).decode(), settings)).size == (8, 8)


async def test_remote_url_refused_by_default(server: str) -> None:
    err = await _refused(server + "red.png", EngineSettings(), "remote image URLs are disabled")
    assert "engine.image_url_allowlist" in err.message


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "/tmp/a.png"])
async def test_other_schemes_refused(url: str) -> None:
    await _refused(url, EngineSettings(image_url_allowlist=["file://", "ftp://", "/"]), "unsupported image URL")


async def test_allow_listed_prefix_is_fetched(server: str) -> None:
    image = await load_image(server + "red.png", EngineSettings(image_url_allowlist=[server]))
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 0, 0)


async def test_allow_list_is_a_prefix_match(server: str) -> None:
    settings = EngineSettings(image_url_allowlist=[server + "images/"])
    await _refused(server + "red.png", settings, "remote image URLs are disabled")


ADMITTED = [
    ("https://a.com", "https://a.com/x.png"),
    ("https://a.com", "https://A.com/x.png"),  # hosts compare case-insensitively
    ("https://A.COM/img", "https://a.com/img/x.png"),
    ("https://a.com/img", "https://a.com/img/x.png"),
    ("https://a.com/img/", "https://a.com/img/x.png"),
    ("https://a.com/img", "https://a.com/img?size=2"),
    ("https://a.com/img", "https://a.com/%69mg/x.png"),  # the same segment, percent-encoded
    ("https://a.com", "https://a.com:443/x.png"),  # the scheme's default port
    ("https://a.com:8443/img", "https://a.com:8443/img/x.png"),
]
REFUSED = [
    ("https://a.com", "https://a.com.evil.net/x.png"),
    ("https://a.com", "https://a.com@evil.net/x.png"),
    ("https://a.com", "https://evil.net@a.com/x.png"),  # user info is refused even on an allowed host
    ("https://a.com", "https://a.com\\@evil.net/x.png"),
    ("https://a.com", "http://a.com/x.png"),
    ("https://a.com", "https://a.com:8443/x.png"),
    ("https://a.com:8443", "https://a.com/x.png"),
    ("https://a.com:80", "https://a.com:8080/x.png"),
    ("https://a.com/img", "https://a.com/imgevil/x.png"),
    ("https://a.com/img", "https://a.com/imgevil"),
    ("https://a.com/img", "https://a.com/img/../secret.png"),
    ("https://a.com/img", "https://a.com/img/%2e%2e/secret.png"),
    ("https://a.com/img", "https://a.com/img/..%2Fsecret.png"),
    ("https://a.com/img/x", "https://a.com/img"),
    ("https://u:p@a.com", "https://u:p@a.com/x.png"),
    ("a.com", "https://a.com/x.png"),  # an entry that is not a URL admits nothing
]


@pytest.mark.parametrize(("entry", "url"), ADMITTED)
def test_allow_list_admits_urls_under_an_entry(entry: str, url: str) -> None:
    _check_allowed(url, ["https://other.org", entry])


@pytest.mark.parametrize(("entry", "url"), REFUSED)
def test_allow_list_compares_scheme_host_port_and_whole_segments(entry: str, url: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _check_allowed(url, [entry])
    assert info.value.param == "messages" and "p@" not in info.value.message


async def test_allow_list_tricks_are_not_fetched(server: str) -> None:
    origin = server.rstrip("/")  # http://127.0.0.1:PORT
    port = origin.rsplit(":", 1)[1]
    await _refused(f"{origin}@localhost:{port}/red.png", EngineSettings(image_url_allowlist=[origin]), "user info")
    settings = EngineSettings(image_url_allowlist=[origin + "/re"])
    await _refused(server + "red.png", settings, "remote image URLs are disabled")
    await _refused(origin + "/re/../red.png", settings, "remote image URLs are disabled")
    await _refused(f"http://127.0.0.1:{port}0/red.png", EngineSettings(image_url_allowlist=[origin]), "disabled")


async def test_allow_listed_segments_are_fetched(server: str) -> None:
    settings = EngineSettings(image_url_allowlist=[server + "images", server + "red.png"])
    assert (await load_image(server + "red.png", settings)).size == (8, 8)
    await _refused(server + "images/x.png", EngineSettings(image_url_allowlist=[server + "images"]), "HTTP 404")


async def test_fetch_errors_are_invalid_requests(server: str) -> None:
    allowed = EngineSettings(image_url_allowlist=[server])
    await _refused(server + "missing.png", allowed, "HTTP 404")
    small = EngineSettings(image_url_allowlist=[server], max_image_bytes=len(PNG) - 1)
    await _refused(server + "red.png", small, "larger than")  # refused from Content-Length
    await _refused(server + "stream", EngineSettings(image_url_allowlist=[server], max_image_bytes=10_000), "larger")


async def test_fetch_timeout(server: str) -> None:
    settings = EngineSettings(image_url_allowlist=[server], image_fetch_timeout_s=0.2)
    started = time.perf_counter()
    await _refused(server + "slow", settings, "timed out")
    assert time.perf_counter() - started < 0.9
