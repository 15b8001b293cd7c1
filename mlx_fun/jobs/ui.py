"""The ``ui`` job: the Gradio dashboard (:mod:`mlx_fun.ui`) for a running ``mlx-fun serve``, until Ctrl+C.

``start(...)`` builds and launches it in the background and returns the running page (``.local_url``,
``.close()``: tests, embedding); ``run(...)`` serves until SIGINT / SIGTERM. The dashboard is a separate process
that reaches the model only over HTTP, so it starts (and keeps working) whether the server is up or not.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import click

from ..core.options import Opt
from ..core.ranges import FiniteFloat
from ..errors import UserError, param
from ..serve.options import API_KEY_ENV
from .common import Log, job, quiet

LOOPBACK = ("127.0.0.1", "localhost", "::1")
INSTALL = "pip install 'mlx-fun[ui]' (in a clone: pip install -e '.[ui]')"


@dataclass
class UIResult:
    url: str
    server_url: str
    share_url: str | None
    seconds: float


def require_ui_extra() -> None:
    """A one-line ``UserError`` when gradio or matplotlib (the ``ui`` extra) is missing."""
    try:
        import gradio  # noqa: F401
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise UserError(f"the dashboard needs the ui extra ({e.name or 'gradio'} is not installed): {INSTALL}."
                        ) from None


def exposure_warnings(host: str, share: bool) -> list[str]:
    """What to tell the user before the dashboard is reachable by others."""
    out = []
    if share:
        out.append("Warning: --share publishes this dashboard on a public gradio.live link: anyone with the link can "
                   "chat with the model, change its steering, save and reset its counts, and read and write files "
                   "in --data-dir — it exposes the server to the internet.")
    if host not in LOOPBACK:
        out.append(f"Warning: the dashboard listens on {host}: anyone who can reach this address can use the server "
                   "through it.")
    return out


def _checked(*, server_url, port, data_dir, timeout) -> tuple[str, Path]:
    from ..ui.client import check_url

    url = check_url(server_url)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise UserError(f"{param('port')} must be 0..65535 (0 picks a free port), got {port!r}.")
    data = Path(data_dir).expanduser()
    if not data.is_dir():
        raise UserError(f"{param('data_dir')} {data_dir} is not a directory; create it or pass another one.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise UserError(f"{param('timeout')} must be a positive number of seconds, got {timeout!r}.")
    require_ui_extra()
    return url, data.resolve()


def _free_port(host: str) -> int:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(*, server_url: str = "http://127.0.0.1:8080", host: str = "127.0.0.1", port: int = 7860,
          share: bool = False, api_key: str | None = None, data_dir: str | Path = ".", timeout: float = 10.0,
          log: Log = quiet):
    """Launch the dashboard without blocking; returns the Gradio page (``.local_url``, ``.close()``). Arguments
    as :func:`run`."""
    from ..ui.app import CSS, build
    from ..ui.client import ServerClient, ServerError
    from ..ui.common import Context

    url, data = _checked(server_url=server_url, port=port, data_dir=data_dir, timeout=timeout)
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    for line in exposure_warnings(host, share):
        log(line)
    client = ServerClient(url, api_key=key, timeout=timeout)
    try:
        client.info()
    except ServerError as e:
        log(f"Warning: {e} The dashboard starts anyway and connects once the server answers.")
    page = build(Context(client, data))
    try:
        page.queue(default_concurrency_limit=8).launch(
            server_name=host, server_port=port or _free_port(host), share=share, prevent_thread_lock=True,
            quiet=True, inbrowser=False, show_error=False, ssr_mode=False, allowed_paths=[str(data)], css=CSS,
            footer_links=[])
    except OSError:  # gradio: "Cannot find empty port in range ..."
        raise UserError(f"cannot listen on {host}:{port} (in use, or not an address of this machine); pass another "
                        f"{param('port')} (0 picks a free one) or {param('host')}.") from None
    return page


@job
def run(
    *,
    server_url: Annotated[str, Opt("The running `mlx-fun serve` (reached only over HTTP).")] = "http://127.0.0.1:8080",
    host: Annotated[str, Opt("Address the dashboard listens on. Anything but loopback exposes the server through "
                             "it.")] = "127.0.0.1",
    port: Annotated[int, Opt("Port (0: a free one).", type=click.IntRange(0, 65535))] = 7860,
    share: Annotated[bool, Opt("Also publish a public gradio.live link: exposes the server to anyone with it (a "
                               "warning is printed).")] = False,
    # the job reads MLX_FUN_API_KEY when none is given
    api_key: Annotated[str | None, Opt(f"The server's API key (its --api-key), sent as a Bearer token.  [env var: "
                                       f"{API_KEY_ENV}]")] = None,
    data_dir: Annotated[str | Path, Opt("Where the Merge and Diff tabs read .npz files and write their exports "
                                        "(nothing outside it).", type=click.Path(file_okay=False))] = ".",
    timeout: Annotated[float, Opt("Seconds each call to the server may take (a chat stream may pause up to 120 s).",
                                  type=FiniteFloat(0.0, min_open=True))] = 10.0,
    log: Log = quiet,
    on_ready=None,
) -> UIResult:
    """Serve the dashboard for the ``mlx-fun serve`` at ``server_url`` until Ctrl+C / SIGTERM.

    ``host`` / ``port``: where the dashboard listens (127.0.0.1 by default; 0 picks a free port). ``api_key`` (or
    ``MLX_FUN_API_KEY``): the server's key, sent as a Bearer token. ``data_dir``: where the Merge and Diff tabs
    read saliency files and write their exports (nothing outside it). ``timeout``: seconds each call to the
    server may take. ``share``: also publish a public gradio.live link (a warning is printed).
    ``on_ready(page)`` is called once the page is up."""
    import contextlib
    import io
    import signal
    import threading

    from ..ui.client import check_url

    begin = time.perf_counter()
    page = start(server_url=server_url, host=host, port=port, share=share, api_key=api_key, data_dir=data_dir,
                 timeout=timeout, log=log)
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        log(f"Serving the dashboard for {server_url} on {page.local_url.rstrip('/')}; Ctrl+C stops.")
        if getattr(page, "share_url", None):
            log(f"Public link (anyone with it can use the server): {page.share_url}")
        if on_ready is not None:
            on_ready(page)
        stop.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        with contextlib.redirect_stdout(io.StringIO()):  # gradio prints "Closing server ..." on stdout
            page.close()
    return UIResult(page.local_url.rstrip("/"), check_url(server_url), getattr(page, "share_url", None),
                    time.perf_counter() - begin)
