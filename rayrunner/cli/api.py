"""The CLI's HTTP client for a running rayrunner: JSON calls and SSE streams, each failure one `CliError` line.

A failure is told by the server's OpenAI error body (`error.message`) when there is one, else by what went wrong
on the way (no connection, a timeout, an answer that is not rayrunner's); the caller never sees a traceback.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 900.0  # a reload or a request to an unloaded model waits for the load (load_timeout_s)


class CliError(Exception):
    """A failure to show as one line on stderr (`error: <message>`), with exit status 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Api:
    """Calls to one rayrunner service; sends `Authorization: Bearer <api_key>` when a key is given."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        try:
            self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        except (httpx.InvalidURL, TypeError) as exc:
            raise CliError(f"`{url}` is not a URL: {exc}") from None

    def get(self, path: str) -> Any:
        with self._calling():
            return _answer(self._http.get(path))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        with self._calling():
            return _answer(self._http.post(path, json=body))

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of an SSE answer; an error event, before or during the stream, raises CliError."""
        with self._calling(), self._http.stream("POST", path, json=body) as response:
            if response.is_error:
                response.read()
                _answer(response)
            yield from parse_sse(response.iter_lines())

    def close(self) -> None:
        self._http.close()

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectError as exc:
            raise CliError(f"cannot reach rayrunner at {self.url}: {exc}") from None
        except httpx.TimeoutException:
            raise CliError(f"rayrunner at {self.url} did not answer within {READ_TIMEOUT_S:.0f} s") from None
        except httpx.HTTPError as exc:
            raise CliError(f"request to rayrunner at {self.url} failed: {exc}") from None


def _answer(response: httpx.Response) -> Any:
    """The JSON of a successful answer; otherwise CliError with the server's message."""
    if response.is_error:
        raise CliError(error_message(response))
    try:
        return response.json()
    except ValueError:
        raise CliError(f"{response.url} did not answer with JSON: is it rayrunner?") from None


def error_message(response: httpx.Response) -> str:
    """`error.message` of an OpenAI error body, else the status and the start of the body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = " ".join(response.text.split())[:200] or response.reason_phrase
        return f"HTTP {response.status_code} from {response.url}: {text}"


def parse_sse(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of `data:` lines up to `[DONE]`. An error event, or a stream cut before `[DONE]`, raises."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise CliError(f"the stream sent an event that is not JSON: {data[:200]}") from None
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            raise CliError(str(event["error"].get("message", event["error"])))
        yield event
    raise CliError("the stream ended before it was complete (no [DONE])")
