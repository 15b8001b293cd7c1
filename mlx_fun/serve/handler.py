"""The HTTP handler: mlx-lm's ``APIHandler`` plus the ``/v1/reap/*`` routes, behind the server's guards.

Every request passes :meth:`ReapHandler._guard` first: the Host header must name this server when it is bound to
a loopback address (DNS-rebinding protection), and with an API key the ``Authorization: Bearer <key>`` header
must match (401; ``/health`` and CORS preflights excepted). Bodies are read here, never past ``max_body_bytes``
(413), parsed as JSON objects (400) and checked before anything else sees them; completions are then handed to
mlx-lm's own ``do_POST`` unchanged except that the model name is normalised to the one served model. Every error
is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape) with one line of text, never a traceback;
an unexpected failure in a route is a 500 of the same shape and the server keeps serving.
"""

from __future__ import annotations

import hmac
import io
import json
import logging

from mlx_lm.server import APIHandler

from . import routes

JSON_TYPES = ("application/json",)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 411: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 503: "unavailable", 500: "server_error"}


class ReapHandler(APIHandler):
    """mlx-lm's handler with guards, checked bodies and the REAP routes (``self.server.app`` is the app)."""

    @property
    def app(self):
        return self.server.app

    # ------------------------------------------------------------------ plumbing
    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        logging.info("%s %s", self.address_string(), format % args)

    def send_json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._set_cors_headers()
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="mlx-fun"')
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, e: HTTPError) -> None:
        self.send_json(e.status, {"error": {"message": str(e), "type": ERROR_TYPES.get(e.status, "error"),
                                            "param": e.param, "code": e.status}})

    def _run(self, fn) -> None:
        """Run a route; any failure becomes one JSON error line and the connection ends cleanly."""
        try:
            fn()
        except HTTPError as e:
            self._safe_error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away
        except Exception as e:  # noqa: BLE001 - never a traceback to a client, never a dead server
            logging.exception("request failed: %s %s", self.command, self.path)
            self._safe_error(HTTPError(500, f"internal error {type(e).__name__}: {' '.join(str(e).split())[:200]}"))

    def _safe_error(self, e: HTTPError) -> None:
        try:
            self.send_error_json(e)
        except (BrokenPipeError, ConnectionResetError, ValueError):
            pass  # headers already sent (a stream was cut) or the client is gone

    # ------------------------------------------------------------------ guards
    def _guard(self) -> None:
        app = self.app
        host = (self.headers.get("Host") or "").strip().lower()
        if app.allowed_hosts is not None and host not in app.allowed_hosts:
            raise HTTPError(403, f"Host header {host or '(none)'!r} is not this server's loopback address "
                                 "(DNS-rebinding protection); connect to 127.0.0.1 or localhost.", "Host")
        if app.api_key and self.path != "/health":
            auth = self.headers.get("Authorization") or ""
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not given or not hmac.compare_digest(given.encode(), app.api_key.encode()):
                why = "missing" if not auth else "wrong"
                raise HTTPError(401, f"API key {why}: send the header 'Authorization: Bearer <key>' with the key "
                                     "the server was started with (--api-key / MLX_FUN_API_KEY).")

    def read_json(self, *, require_json_type: bool) -> dict:
        """The request body as a JSON object, size-checked before it is read."""
        length = self.headers.get("Content-Length")
        if length is None:
            if self.headers.get("Transfer-Encoding"):
                raise HTTPError(411, "chunked bodies are not accepted; send a Content-Length header.")
            return {}
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            raise HTTPError(400, f"Content-Length {length!r} is not a byte count.", "Content-Length") from None
        if n > self.app.max_body_bytes:
            self.close_connection = True
            self._drain(n)
            raise HTTPError(413, f"request body of {n:,} bytes is over this server's limit of "
                                 f"{self.app.max_body_bytes:,} (--max-body-bytes).")
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        raw = self.rfile.read(n)
        if require_json_type and n and ctype not in JSON_TYPES:
            raise HTTPError(415, f"Content-Type {ctype or '(none)'!r} is not accepted here; send the JSON body with "
                                 "'Content-Type: application/json'.", "Content-Type")
        if not n:
            return {}
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HTTPError(400, f"the request body is not valid JSON ({e}).") from None
        if not isinstance(body, dict):
            raise HTTPError(400, f"the request body must be a JSON object, got {type(body).__name__}.")
        return body

    def _drain(self, n: int, cap: int = 64 << 20) -> None:
        """Read (and drop) a refused body so the client can read the 413; huge ones just get the connection cut."""
        if n > cap:
            return
        self.connection.settimeout(5)
        try:
            while n > 0:
                chunk = self.rfile.read(min(n, 1 << 20))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:
            pass

    # ------------------------------------------------------------------ methods
    def do_GET(self):
        def go():
            self._guard()
            path = self.path.split("?")[0]
            if path.startswith("/v1/reap/"):
                return routes.get(self, path)
            if path.startswith("/v1/models"):
                return self.send_json(200, {"object": "list", "data": [self.app.model_card(self.created)]})
            return APIHandler.do_GET(self)

        self._run(go)

    def do_POST(self):
        def go():
            self._guard()
            path = self.path.split("?")[0]
            if path.startswith("/v1/reap/"):
                return routes.post(self, path, self.read_json(require_json_type=True))
            if path not in ("/v1/completions", "/v1/chat/completions", "/chat/completions"):
                raise HTTPError(404, f"no route POST {path}; see GET /v1/reap/info for this server's routes.")
            body = routes.check_completion(self, path, self.read_json(require_json_type=False))
            self.app.counter_or_503()
            data = json.dumps(body).encode()
            self.rfile = io.BytesIO(data)
            del self.headers["Content-Length"]
            self.headers["Content-Length"] = str(len(data))
            APIHandler.do_POST(self)

        self._run(go)

    def _not_allowed(self):
        def go():
            self._guard()
            raise HTTPError(405, f"method {self.command} is not served; routes: GET /v1/reap/info lists them.")

        self._run(go)

    do_PUT = do_PATCH = _not_allowed

    def do_DELETE(self):
        def go():
            self._guard()
            path = self.path.split("?")[0]
            if path == "/v1/reap/steer":
                return routes.delete_steer(self)
            raise HTTPError(404 if not path.startswith("/v1/reap/") else 405, f"no route DELETE {path}.")

        self._run(go)
