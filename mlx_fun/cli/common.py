"""Shared click options and the error handling every command uses."""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import sys

import click

from ..datasets.samples import MAX_SAMPLE_BYTES
from ..errors import UserError, cli_names
from ..core.ranges import DRAFT_TOKENS, MAX_SEED, SEED, TEMPERATURE, TOP_K, TOP_P, FiniteFloat  # noqa: F401 (re-exported)
from ..observe.saliency import METRICS


DEBUG_ENV = "MLX_FUN_DEBUG"


def debug_enabled() -> bool:
    """``mlx-fun --debug`` or ``MLX_FUN_DEBUG=1``: let unexpected exceptions show their traceback."""
    from ..core.env import flag

    if flag(DEBUG_ENV):
        return True
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and (root.obj or {}).get("debug"))


def _os_error_line(e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    fix = {errno.ENOSPC: "free some space or write elsewhere", errno.EROFS: "choose a writable location",
           errno.EACCES: "check the permissions or choose another location",
           errno.EPERM: "check the permissions or choose another location",
           errno.ENOENT: "check the path", errno.EFBIG: "the file size limit (ulimit -f) was reached"}.get(
        e.errno, "check the path and the disk")
    return f"{e.strerror or e}{where}; {fix}."


def friendly_errors(fn):
    """One line on stderr for every failure, never a traceback (unless ``--debug`` / ``MLX_FUN_DEBUG=1``).

    ``UserError`` and I/O errors → ``Error: <message>``, exit 2. Ctrl-C → exit 130, SIGTERM / SIGHUP → 128 +
    the signal (outputs in progress are removed by :mod:`mlx_fun.core.writer` first). Anything else is a bug:
    ``Error: internal error ...``, exit 1.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with sparing_stderr():
            return _friendly(fn, args, kwargs)

    return wrapper


def _friendly(fn, args, kwargs):
    """:func:`friendly_errors`' body: ``fn`` run, each failure one line and its exit status."""
    from ..core.writer import Terminated

    try:
        with cli_names():
            return fn(*args, **kwargs)
    except UserError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        if debug_enabled():
            raise
        click.echo(f"Error: {_os_error_line(e)}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("Interrupted; outputs not yet complete were removed.", err=True)
        sys.exit(130)
    except Terminated as e:
        click.echo(f"Interrupted by {e}; outputs not yet complete were removed.", err=True)
        sys.exit(128 + e.signum)
    except click.exceptions.ClickException:
        raise
    except Exception as e:  # noqa: BLE001 - a bug or a backend failure: one line, traceback on request
        if debug_enabled():
            raise
        detail = " ".join(str(e).split())[:300]
        click.echo(f"Error: internal error {type(e).__name__}: {detail} (run with `mlx-fun --debug` or "
                   f"{DEBUG_ENV}=1 for the traceback, and please report it).", err=True)
        sys.exit(1)


class _SparingRaw(io.RawIOBase):
    """File descriptor 2, written with ``os.write``; what cannot be written (stderr closed, full, a broken pipe)
    is dropped: nothing stays buffered to fail again at exit."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return os.write(2, data)
        except OSError:
            return len(data)

    def isatty(self) -> bool:
        try:
            return os.isatty(2)
        except OSError:
            return False


class _Sparing:
    """Another ``sys.stderr`` (a test's capture, a caller's stream) that swallows the errors of writing to it."""

    def __init__(self, stream):
        self._wrapped = stream

    def write(self, text):
        try:
            return self._wrapped.write(text)
        except (OSError, ValueError):  # full, broken or closed
            return len(text)

    def flush(self) -> None:
        try:
            self._wrapped.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


@contextlib.contextmanager
def sparing_stderr():
    """While a command runs, status lines, warnings and progress bars on stderr can never fail it: a closed
    (``2>&-``), full (``2>/dev/full``) or broken stderr drops them, and the run completes with its own exit status.
    A closed descriptor 2 is first pointed at /dev/null, so no file the run opens can become "stderr"."""
    try:
        os.fstat(2)
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        if null != 2:
            os.dup2(null, 2)
            os.close(null)
    before = sys.stderr
    if before is None or before is sys.__stderr__:
        try:
            before is not None and before.flush()
        except (OSError, ValueError):
            pass
        sys.stderr = io.TextIOWrapper(_SparingRaw(), encoding="utf-8", errors="backslashreplace",
                                      line_buffering=True, write_through=True)
    else:
        sys.stderr = _Sparing(before)
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        sys.stderr = before




def model_option(fn):
    """--model (a local directory or a Hugging Face repo id) and --revision (of that repo)."""
    fn = click.option(
        "--revision", default=None, metavar="REV",
        help="With a repo id in --model: its branch, tag or commit hash  [default: main].",
    )(fn)
    return click.option("--model", required=True, type=click.Path(),
                        help="An mlx-lm model: a local directory (config.json + safetensors + tokenizer), or a Hugging "
                             "Face repo id (org/name) fetched into the Hugging Face cache as mlx-lm does (only the "
                             "files mlx-lm needs; HF_HUB_OFFLINE=1: from the cache alone). A local directory of that "
                             "name wins over the repo.")(fn)


def generation_options(fn):
    """mlx-lm's KV-cache and speculative-decoding options (mlx_fun.model.genopts), as mlx_lm.generate names them."""
    from ..model.genopts import KV_BITS, KV_GROUP_SIZES

    for option in reversed((
        click.option("--kv-bits", type=click.Choice([str(b) for b in KV_BITS]), default=None,
                     callback=lambda _c, _p, v: None if v is None else int(v),
                     help="Quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache)  [default: float]."),
        click.option("--kv-group-size", type=click.Choice([str(g) for g in KV_GROUP_SIZES]), default="64",
                     show_default=True, callback=lambda _c, _p, v: int(v), help="Group size of the quantized KV cache."),
        click.option("--quantized-kv-start", type=click.IntRange(min=0), default=5000, show_default=True,
                     help="With --kv-bits: quantize the cache once it holds this many tokens (0: from the start)."),
        click.option("--max-kv-size", type=click.IntRange(min=1), default=None,
                     help="Keep at most this many tokens in the KV cache (mlx-lm's rotating cache; not with "
                          "--kv-bits or --draft-model)."),
        click.option("--draft-model", type=click.Path(), default=None,
                     help="A smaller model with the same tokenizer for speculative decoding (mlx-lm's; a directory "
                          "or a repo id). Greedy output is unchanged; --temp > 0 samples as mlx-lm does then."),
        click.option("--num-draft-tokens", type=DRAFT_TOKENS, default=2, show_default=True,
                     help="Tokens the draft model proposes per step."),
    )):
        fn = option(fn)
    return fn


def metric_option(default: str = "reap"):
    return click.option(
        "--metric",
        type=click.Choice(METRICS),
        default=default,
        show_default=True,
        help="Saliency metric: reap = mean(‖y‖·w), ean = mean(‖y‖), freq = routed count, weighted_freq = Σw.",
    )


def dataset_options(fn):
    """--dataset/--max-samples/--max-tokens/--text-key/--seed, shared by every command that reads data."""
    fn = click.option("--seed", type=SEED, default=None, help="Seed for the random subset of samples.")(fn)
    fn = click.option(
        "--text-key", default="content", show_default=True, help="JSON key of plain-text JSONL lines."
    )(fn)
    fn = click.option(
        "--max-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
        help="Truncate every sample to this many tokens.",
    )(fn)
    fn = click.option(
        "--max-samples", type=click.IntRange(min=1), default=128, show_default=True,
        help="Use at most this many samples (a random subset when the dataset has more).",
    )(fn)
    fn = click.option(
        "--dataset", required=True, type=click.Path(),
        help="JSONL file (messages / prompt+completion / text lines, detected per line) or a directory of files; "
             f"UTF-8, each line (or file) at most {MAX_SAMPLE_BYTES >> 20} MiB, no devices or FIFOs.",
    )(fn)
    return fn


def scan_options(names: tuple[str, str], helps: tuple[str, str]):
    """The two datasets of a differential scan plus --output and the sampling / threshold options."""

    def deco(fn):
        fn = click.option("--threshold-percentile", type=FiniteFloat(50, 100, min_open=True, max_open=True),
                          default=90.0, show_default=True,
                          help="Composite-score percentile above which (and below 100 minus which) experts are "
                               "classified.")(fn)
        fn = click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
                          help="Samples per forward pass (padding excluded).")(fn)
        fn = click.option("--seed", type=SEED, default=None, help="Seed for the random subset of samples.")(fn)
        fn = click.option("--text-key", default="content", show_default=True,
                          help="JSON key of plain-text JSONL lines.")(fn)
        fn = click.option("--max-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
                          help="Truncate every sample to this many tokens.")(fn)
        fn = click.option("--max-samples", type=click.IntRange(min=1), default=128, show_default=True,
                          help="Samples per dataset (a random subset when it has more).")(fn)
        fn = force_option()(fn)
        fn = click.option("--output", required=True, type=click.Path(dir_okay=False),
                          help="The report to write (JSON).")(fn)
        for name, text in reversed(list(zip(names, helps))):
            fn = click.option(f"--{name}", required=True, type=click.Path(), help=text)(fn)
        return fn

    return deco


def force_option(what: str = "an existing --output file"):
    """--force: the one way to let a command replace what exists (mlx_fun.core.writer refuses it otherwise)."""
    return click.option("--force", is_flag=True, default=False,
                        help=f"Replace {what}; refused otherwise (inputs, links and devices never are).")


def echo_err(line: str) -> None:
    """Status lines and warnings go to stderr (stdout carries the results)."""
    click.echo(line, err=True)


def dispatch_option(fn):
    """--dispatch [auto|mlx-lm], --dispatch-table PATH, --dequant-cache SIZE, passed to the job as they are."""
    fn = click.option(
        "--dequant-cache", default="0", show_default=True, metavar="SIZE",
        help="With --dispatch auto: memory allowed for keeping dequantized experts of quantized layers "
             "(e.g. 4GiB; K/M/G are powers of 1024), used where the table says it is faster. 0 = off.",
    )(fn)
    fn = click.option(
        "--dispatch-table", type=click.Path(dir_okay=False), default=None,
        help="Extra cut-off table (JSON from `mlx-fun tune-dispatch`) over the shipped and user tables.",
    )(fn)
    fn = click.option(
        "--dispatch", type=click.Choice(["auto", "mlx-lm"]), default="auto", show_default=True,
        help="MoE expert dispatch: auto picks sorted/unsorted/blocked/dequantized per token count from measured "
             "per-backend cut-offs (and splits calls a backend cannot launch); mlx-lm keeps mlx-lm's fixed rule.",
    )(fn)
    return fn


def take(kwargs: dict, group: type, **extra):
    """Build option group ``group`` (a dataclass: :class:`mlx_fun.settings.RunSettings`,
    :class:`mlx_fun.model.genopts.GenOptions`, ...) from the parsed options named as its fields, removing them from
    ``kwargs``; ``extra`` sets fields the command decides itself (``progress=True``)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(group)}
    return group(**{k: kwargs.pop(k) for k in list(kwargs) if k in names}, **extra)


def run_settings(kwargs: dict, *, progress: bool = True):
    """The :class:`mlx_fun.settings.RunSettings` of ``--dispatch`` / ``--dispatch-table`` / ``--dequant-cache`` /
    ``--token-budget`` (those the command has), taken out of ``kwargs``; ``progress``: show progress bars."""
    from ..settings import RunSettings

    return take(kwargs, RunSettings, progress=progress)


def token_budget_option(fn):
    return click.option(
        "--token-budget", type=click.IntRange(min=1), default=None, metavar="N",
        help="Most tokens (rows × columns) per forward pass: larger batches are split and longer samples fed in "
             "chunks with the KV cache, so no batch size or length can exhaust memory [default: 8192].",
    )(fn)


def fmt_number(x: float) -> str:
    return f"{x:.6g}"


def text_table(headers: list[str], rows: list[list[str]], indent: str = "  ", align: str = "") -> str:
    """Aligned text table; ``align`` has one 'l' or 'r' per column (missing: right-aligned, for numbers)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return indent + "  ".join(c.ljust(w) if align[i:i + 1] == "l" else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def echo_warnings(messages: list[str]) -> None:
    for msg in messages:
        click.echo(f"Warning: {msg}", err=True)
