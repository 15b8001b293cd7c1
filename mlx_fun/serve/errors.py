"""The one HTTP error type of ``mlx-fun serve``: raised by the handler, its routes and the completion checks,
answered by the handler as ``{"error": {"message", "type", "param", "code"}}``. Its own module, so the routes
need not import the handler that imports them."""

from __future__ import annotations


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param
