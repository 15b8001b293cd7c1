"""The dashboard's only way to the model: ``mlx-fun serve``'s HTTP API, with the server's API key when one is set.

Standard library only (``urllib``). Every failure — server down, timeout, an error answer, a body that is not
JSON, a stream cut short — becomes a :class:`ServerError` whose message is one line a person can act on; the
page shows it and keeps working, and the next call simply tries again (no connection state is kept).

Routes used (``mlx_fun/serve/routes.py``): ``GET /health``, ``GET /v1/reap/info``, ``GET /v1/reap/stats``,
``GET|POST|DELETE /v1/reap/steer``, ``POST /v1/reap/save``, ``POST /v1/reap/reset`` and ``POST
/v1/chat/completions`` with ``"stream": true`` (server-sent events).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

from ..errors import UserError, param

#: what a lost, refused or broken connection raises, while connecting or while reading
NETWORK_ERRORS = (urllib.error.URLError, OSError, http.client.HTTPException)


class ServerError(Exception):
    """One line: what went wrong talking to the server and what to do."""


def one_line(text) -> str:
    return " ".join(str(text).split())


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or a one-line :class:`UserError` naming the problem."""
    text = str(url).strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{param('server_url')} {url!r} is not an http(s) URL; give one like http://127.0.0.1:8080.")
    try:
        parts.port
    except ValueError:
        raise UserError(f"{param('server_url')} {url!r} has a bad port; give one like http://127.0.0.1:8080.") from None
    return text.rstrip("/")


class ServerClient:
    """``serve``'s routes as methods. ``timeout`` (seconds) bounds every call; a chat stream waits at least
    :attr:`STREAM_TIMEOUT` between two events (a long prompt's prefill sends nothing for a while)."""

    STREAM_TIMEOUT = 120.0

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 10.0):
        self.url = check_url(url)
        self.api_key = api_key or None
        self.timeout = float(timeout)

    # ------------------------------------------------------------------------------------------ plumbing
    def _unreachable(self, e: BaseException) -> ServerError:
        return ServerError(f"cannot reach the server at {self.url} ({_reason(e)}); start `mlx-fun serve` there or "
                           "pass the right --server-url.")

    def _request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            raise self._answered(e, method, path) from None
        except NETWORK_ERRORS as e:
            raise self._unreachable(e) from None

    def _answered(self, e: urllib.error.HTTPError, method: str, path: str) -> ServerError:
        text = _error_text(e)
        if e.code == 401:
            hint = ("pass the server's key with --api-key or MLX_FUN_API_KEY" if not self.api_key else
                    "the --api-key given does not match the server's")
            return ServerError(f"the server at {self.url} requires an API key ({text}); {hint}.")
        return ServerError(f"the server answered {e.code} to {method} {path}: {text}")

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            with self._request(method, path, body) as resp:
                raw = resp.read()
        except NETWORK_ERRORS as e:
            raise self._unreachable(e) from None
        try:
            out = json.loads(raw)
        except ValueError:
            raise ServerError(f"the answer to {method} {path} is not JSON; is {self.url} an `mlx-fun serve`?") from None
        if not isinstance(out, dict):
            raise ServerError(f"the answer to {method} {path} is not a JSON object; is {self.url} an `mlx-fun serve`?")
        return out

    # ------------------------------------------------------------------------------------------ routes
    def health(self) -> dict:
        return self._json("GET", "/health")

    def info(self) -> dict:
        return self._json("GET", "/v1/reap/info")

    def stats(self) -> dict:
        return self._json("GET", "/v1/reap/stats")

    def steering(self) -> dict:
        return self._json("GET", "/v1/reap/steer")

    def steer(self, body: dict) -> dict:
        return self._json("POST", "/v1/reap/steer", body)

    def unsteer(self) -> dict:
        return self._json("DELETE", "/v1/reap/steer")

    def save(self, path: str) -> dict:
        return self._json("POST", "/v1/reap/save", {"path": path})

    def reset(self) -> dict:
        return self._json("POST", "/v1/reap/reset", {})

    def chat(self, messages: list[dict], *, temperature: float = 0.0, max_tokens: int = 256) -> Iterator[str]:
        """Stream a chat completion: yields the reply's text pieces as the server sends them (SSE)."""
        body = {"model": "default_model", "messages": messages, "temperature": float(temperature),
                "max_tokens": int(max_tokens), "stream": True}
        resp = self._request("POST", "/v1/chat/completions", body, timeout=max(self.timeout, self.STREAM_TIMEOUT))
        with resp:
            try:
                yield from _stream_pieces(resp)
            except NETWORK_ERRORS as e:
                raise ServerError(f"the reply stopped: lost the server at {self.url} ({_reason(e)}).") from None


def _stream_pieces(resp) -> Iterator[str]:
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError:
            raise ServerError("the server sent a stream event that is not JSON; is this an `mlx-fun serve`?") from None
        if isinstance(event, dict) and "error" in event:
            raise ServerError(f"the server stopped the reply: {_message(event['error'])}")
        for choice in (event.get("choices") if isinstance(event, dict) else None) or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                yield piece


def _message(err) -> str:
    if isinstance(err, dict):
        err = err.get("message", err)
    return one_line(err)


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read() or b"{}")
    except (ValueError, OSError):
        body = {}
    text = _message(body.get("error", "")) if isinstance(body, dict) else ""
    return text or one_line(e.reason or "") or "no details"


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", e)
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, (ConnectionResetError, http.client.RemoteDisconnected)):
        return "connection closed"
    if isinstance(reason, socket.gaierror):
        return "unknown host"
    return one_line(reason) or type(reason).__name__
