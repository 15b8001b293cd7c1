"""The HTTP handler: mlx-lm's ``APIHandler`` plus the ``/v1/reap/*`` routes, behind the server's guards.

Every request passes :meth:`ReapHandler._guard` first: the Host header must name this server when it is bound to
a loopback address (DNS-rebinding protection), and with an API key the ``Authorization: Bearer <key>`` header
must match (401; ``/health`` and CORS preflights excepted). Bodies are read here, never past ``max_body_bytes``
(413), parsed as JSON objects nested at most :data:`MAX_DEPTH` deep (400) and checked before anything else sees
them; a request's line, headers and body must arrive within ``--request-timeout`` (:class:`TimedReads`), and
http.server's own refusals (bad request lines, oversized headers, unserved methods) are answered in this shape
too; completions are then handed to mlx-lm's own ``do_POST`` unchanged except that the model name is normalised
to the one served model, through a :class:`WatchedGenerator` that stops a request whose client has gone and
answers in this shape what mlx-lm's loop refuses. Every error is ``{"error": {"message", "type", "param",
"code"}}`` (OpenAI's shape) with one line of text, never a traceback; an unexpected failure in a route is a 500
of the same shape and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import re
import socket
import time

from mlx_lm.server import APIHandler

from ..core import json_input
from . import routes
from .errors import HTTPError

JSON_TYPES = ("application/json",)


#: deepest nesting of a request body (a steering or completion body needs a handful; deeper ones would reach the
#: interpreter's recursion limit in the parser, the checks or mlx-lm)
MAX_DEPTH = 32
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def too_deep(body, raw: bytes):
    """``False`` when ``body`` (parsed, or None when the parser gave up) nests at most :data:`MAX_DEPTH` levels;
    else the top-level key whose value nests deeper (None when there is none to name)."""
    if body is not None:
        return json_input.too_deep(body, MAX_DEPTH)
    depth, key, last = 0, None, None  # the parser gave up: find the key in the raw text
    for m in _JSON_TOKENS.finditer(raw):
        tok = m.group()
        if tok in (b"{", b"["):
            depth += 1
            if depth == 2:
                key = last
            if depth > MAX_DEPTH:
                return key
        elif tok in (b"}", b"]"):
            depth -= 1
        elif depth == 1:
            last = tok[1:-1].decode("utf-8", "replace")
    return None


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               411: "invalid_request_error", 413: "invalid_request_error", 414: "invalid_request_error",
               415: "invalid_request_error", 431: "invalid_request_error", 503: "unavailable", 500: "server_error"}
#: the methods some route serves (the Allow header of a 405)
ALLOWED = "GET, POST, DELETE, OPTIONS"


class Evicted(TimeoutError):
    """The connection was closed to make room (:meth:`TimedReads.evict`) while the server waited for its request."""


class TimedReads(io.RawIOBase):
    """A connection's reads, each bounded by what is left of the current request's time: past ``start(seconds)``'s
    deadline a read raises ``TimeoutError``, so a client that sends its request line, headers or body slowly (or
    not at all) holds its thread at most that long. The socket stays blocking otherwise (writes, and
    :func:`client_gone`'s peek, which a socket timeout would turn into a wait).

    ``waiting_since`` is when the read now blocked on the client began (None: not waiting on the client): a server at
    its connection bound evicts (:meth:`evict`) the connection that has waited longest, so clients that send nothing
    cannot keep the others out."""

    def __init__(self, sock):
        self._sock, self._deadline = sock, None
        self.waiting_since: float | None = None
        self.evicted = False

    def readable(self) -> bool:
        return True

    def start(self, seconds: float) -> None:
        self._deadline = time.monotonic() + seconds

    def readinto(self, b) -> int:
        left = None if self._deadline is None else self._deadline - time.monotonic()
        if self.evicted:
            raise Evicted("the connection was closed to make room for others")
        if left is not None and left <= 0:
            raise TimeoutError("the request took too long to arrive")
        self._sock.settimeout(left)
        self.waiting_since = time.monotonic()
        try:
            n = self._sock.recv_into(b)
        finally:
            self.waiting_since = None
            self._sock.settimeout(None)
        if self.evicted:  # woken by evict(): what arrived is not a request's end, never run a cut request
            raise Evicted("the connection was closed to make room for others")
        return n

    def evict(self) -> None:
        """End the wait for this client's request: its reads raise :class:`Evicted` (its thread answers a late
        body with 408 and closes the connection, as at the deadline); its writes still work."""
        self.evicted = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RD)  # wakes a blocked recv


def client_gone(sock) -> bool:
    """Has the client closed its end of ``sock``? (Readable with nothing to read; a pipelined next request is data,
    so a live client.) Never blocks."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset, or the socket is gone
        return True


class Answered(BaseException):
    """The response has been sent: unwinds past mlx-lm's handler, whose ``except Exception`` would answer again."""


class WatchedGenerator:
    """The shared response generator as one request's handler sees it: once the client has closed the connection,
    the next token (or prompt-progress report) stops the request — ``GenerationContext.stop()``, which mlx-lm's
    loop checks after every token and then drops the request — and raises ``ConnectionResetError`` in the handler.
    mlx-lm itself notices only a failed write, which a non-streaming request makes once, at the end."""

    def __init__(self, shared, handler):
        self._shared, self._handler, self._sock = shared, handler, handler.connection

    def __getattr__(self, name):
        return getattr(self._shared, name)

    def generate(self, request, generation_args, progress_callback=None):
        ctx = None

        def progress(done: int, total: int) -> None:
            self._alive_or_stop(ctx)
            if progress_callback is not None:
                progress_callback(done, total)

        try:
            ctx, tokens = self._shared.generate(request, generation_args, progress)
        except Exception as e:  # noqa: BLE001 - mlx-lm would answer 404 {"error": ...} to all of these
            raise self._refused(request, e) from None
        return ctx, self._watched(ctx, tokens)

    def _refused(self, request, e: Exception) -> "Answered":
        """Answer a request mlx-lm's loop refused (its template or tokenizer failed on it: 400) or could not take
        (the generation thread has stopped: 503) in this server's JSON shape, past mlx-lm's own handler."""
        if isinstance(e, HTTPError):  # refused by the generator (a prompt over the limit)
            error = e
        elif not self._shared.generation_available():
            error = HTTPError(503, "the generation thread has stopped; restart the server.")
        else:
            field = "messages" if request.request_type == "chat" else "prompt"
            detail = " ".join(str(e).split())[:200] or type(e).__name__
            error = HTTPError(400, f"the model's template or tokenizer failed on this request's {field} "
                                   f"({detail}); fix the request.", field)
        self._handler.send_error_json(error)
        return Answered()

    def _watched(self, ctx, tokens):
        for response in tokens:
            self._alive_or_stop(ctx)
            yield response

    def _alive_or_stop(self, ctx) -> None:
        if client_gone(self._sock):
            if ctx is not None:
                ctx.stop()
            raise ConnectionResetError("the client closed the connection")


class ReapHandler(APIHandler):
    """mlx-lm's handler with guards, checked bodies and the REAP routes (``self.server.app`` is the app)."""

    @property
    def app(self):
        return self.server.app

    # ------------------------------------------------------------------ plumbing
    def setup(self):
        """http.server's streams, but reads through :class:`TimedReads` (each request gets ``--request-timeout``
        seconds to arrive, from its first byte's wait on)."""
        super().setup()
        self.rfile.close()  # the socket's own reader: closed, or the socket would stay open after the request
        self._reads = TimedReads(self.connection)
        self.rfile = io.BufferedReader(self._reads)
        self.server.waiting_on[self.connection] = self._reads

    def handle_one_request(self):
        """http.server's, under the request's deadline: a client that has not sent its request line, headers and
        body in time is closed (with a 408 when it was the body that was late), and nothing is counted for it."""
        self._reads.start(self.app.request_timeout)
        try:
            super().handle_one_request()
        except TimeoutError:  # in the headers (http.server itself catches the request line's)
            logging.info("%s: request headers timed out", self.address_string())
            self.close_connection = True

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        logging.info("%s %s", self.address_string(), format % args)

    def send_json(self, status: int, obj, *, headers: dict | None = None, cors: bool = True) -> None:
        """``obj`` as the JSON body (left out for a HEAD request, whose answer is the headers alone)."""
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if cors:
            self._set_cors_headers()
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="mlx-fun"')
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error_json(self, e: HTTPError, *, headers: dict | None = None, cors: bool = True) -> None:
        if e.status == 405:
            headers = {**(headers or {}), "Allow": ALLOWED}
        self.send_json(e.status, {"error": {"message": str(e), "type": ERROR_TYPES.get(e.status, "error"),
                                            "param": e.param, "code": e.status}}, headers=headers, cors=cors)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals — a malformed request line (400), one over 64 KiB (414), headers over its
        limits (431), a method no route serves (its 501: 405 with ``Allow``), an HTTP version it does not speak (its
        505: 400) — in this server's JSON shape; the connection is closed after it."""
        code = int(code)
        headers = {"Connection": "close"}
        if code == 501:
            code, text = 405, f"method {self.command!r} is not served; use one of {ALLOWED}."
        elif code == 431:
            text = ("the request's headers are over this server's limits (at most 100 headers, each line at most "
                    "64 KiB); send fewer or shorter headers.")
        elif code == 414:
            text = "the request line is over 64 KiB; send a shorter URL."
        else:
            text = f"{message or self.responses.get(code, ('bad request',))[0]}; send a well-formed HTTP/1.1 request."
            code = 400 if code >= 500 else code
        logging.info("%s refused: %d %s", self.address_string(), code, text)
        self.close_connection = True
        self.send_error_json(HTTPError(code, " ".join(text.split())), headers=headers,
                             cors=hasattr(self, "headers"))  # (none yet when they were what failed)

    def _run(self, fn) -> None:
        """Run a route; any failure becomes one JSON error line and the connection ends cleanly."""
        try:
            fn()
        except HTTPError as e:
            self._safe_error(e)
        except Answered:
            pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away
        except TimeoutError as e:  # the body did not arrive in time, or the wait for it made room (TimedReads)
            self.close_connection = True
            why = (f"the server is at its --max-connections ({self.app.max_connections}) and this request had "
                   "not arrived" if isinstance(e, Evicted) else
                   f"the request did not arrive within {self.app.request_timeout:g} s (--request-timeout)")
            self._safe_error(HTTPError(408, f"{why}; send it whole, promptly."))
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
        if app.api_key and self.path.split("?")[0] != "/health":  # the path alone, not its query
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
        except RecursionError:  # nested past the parser's stack
            body = None
        field = too_deep(body, raw)
        if field is not False:
            raise HTTPError(400, f"{field or 'the request body'} is nested more than {MAX_DEPTH} levels deep; "
                                 "send a flatter body.", field)
        if not isinstance(body, dict):
            raise HTTPError(400, f"the request body must be a JSON object, got {type(body).__name__}.")
        return body

    def _drain(self, n: int, cap: int = 64 << 20) -> None:
        """Read (and drop) a refused body so the client can read the 413; huge ones just get the connection cut."""
        if n > cap:
            return
        try:  # (within the request's deadline: TimedReads)
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
            if path == "/health":
                self.path = path
                return APIHandler.do_GET(self)
            raise HTTPError(404, f"no route GET {path}; see GET /v1/reap/info for this server's routes.")

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
            self.path = path  # mlx-lm looks the route up by the whole path, query included
            APIHandler.do_POST(self)

        self._run(go)

    def handle_completion(self, request, stop_words):
        """mlx-lm's, through a :class:`WatchedGenerator`: a request whose client has gone stops generating."""
        shared = self.response_generator
        self.response_generator = WatchedGenerator(shared, self)
        try:
            super().handle_completion(request, stop_words)
        finally:
            self.response_generator = shared

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
