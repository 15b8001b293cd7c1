"""The one reader of JSON from user-provided bytes: config.json, dispatch tables, expert lists, safety / domain
reports, JSONL dataset lines, safetensors headers, corpus manifests, typed steering bodies.

:func:`parse` turns any bytes into a value or into one line naming where the bytes came from (the file, the
file and line of a JSONL sample), the problem and the fix: text that is not UTF-8, that is not JSON (the parser's
message, line and column), ``NaN`` / ``Infinity`` where the file's kind forbids them (strict JSON does), nesting
deeper than :data:`MAX_DEPTH` (a document nested 100k deep used to stop the run with an internal
``RecursionError``; one the parser accepts a few hundred levels deep still broke later code that recurses: every
such file is refused here, before anything else sees it) and a top-level value of the wrong type. :func:`read`
does the same for a file, which must be a regular file of at most ``max_bytes``.

A leaf module (the BLAS set-up reads the mlx.launch host file with it before ``mlx`` is imported).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UserError

#: the deepest nesting of arrays / objects accepted: the files mlx-fun reads nest a handful of levels
MAX_DEPTH = 64
#: the largest JSON file read (the largest mlx-fun reads, a dispatch table, is a few kB; this bounds what a wrong
#: path, say a device or a weight file, can cost)
MAX_BYTES = 64 << 20

_KINDS = {dict: "a JSON object", list: "a JSON list"}


class _Constant(ValueError):
    pass


def _refuse_constant(name: str):
    raise _Constant(name)


def too_deep(value, limit: int):
    """``False`` when ``value`` nests arrays / objects at most ``limit`` levels deep (iterative: no recursion); else
    the top-level key whose value nests deeper (None when ``value`` is no object, so there is no key to name)."""
    todo = [(v, 2, k) for k, v in value.items()] if isinstance(value, dict) else [(value, 1, None)]
    while todo:
        item, depth, key = todo.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return key
            todo.extend((v, depth + 1, key) for v in (item.values() if isinstance(item, dict) else item))
    return False


def json_type_name(value) -> str:
    """How a message names the JSON type of ``value``: "an object", "a list", "a string", "null", ..."""
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), f"a {type(value).__name__}")


def parse(data: str | bytes, where: str, *, fix: str = "", expect: type | None = None, allow_nan: bool = False,
          object_pairs_hook=None, error: type[Exception] = UserError, encoding: str = "utf-8", lines: bool = True):
    """The JSON value of ``data`` (bytes are decoded with ``encoding``; ``utf-8-sig`` also takes a BOM).

    Anything else is one line ``"<where> <problem>; <fix>"`` raised as ``error`` (``UserError`` by default; a
    reader whose callers add their own fix passes ``ValueError`` and no ``fix``): ``where`` names the source
    (``"dispatch table /x/t.json"``, ``"/x/data.jsonl line 4"``). ``expect``: the type the top-level value must
    have (``dict`` or ``list``); ``allow_nan``: accept ``NaN`` / ``Infinity`` / ``-Infinity`` (Python's json
    writes them; strict JSON and most of mlx-fun's files forbid them); ``object_pairs_hook``: as for
    :func:`json.loads` (an expert list refuses duplicate keys with it); ``lines=False``: a syntax error is placed
    by its column only (``where`` names the line of a JSONL file)."""
    tail = f"; {fix}" if fix else ""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode(encoding)
        except UnicodeDecodeError as e:
            raise error(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}){tail}") from None
    kwargs = {} if allow_nan else {"parse_constant": _refuse_constant}
    try:
        value = json.loads(data, object_pairs_hook=object_pairs_hook, **kwargs)
    except _Constant as e:
        raise error(f"{where} holds {e}, which JSON does not allow (write null or a number){tail}") from None
    except json.JSONDecodeError as e:
        at = f"line {e.lineno}, column {e.colno}" if lines else f"column {e.colno}"
        raise error(f"{where} is not valid JSON ({e.msg} at {at}){tail}") from None
    except RecursionError:  # nested past the parser's stack
        value = None
        deep = True
    else:
        deep = too_deep(value, MAX_DEPTH) is not False
    if deep:
        raise error(f"{where} nests arrays / objects more than {MAX_DEPTH} levels deep, which no file of this kind "
                    f"does{tail}")
    if expect is not None and not isinstance(value, expect):
        raise error(f"{where} holds {json_type_name(value)}, not {_KINDS.get(expect, expect.__name__)}{tail}")
    return value


def read(path: str | os.PathLike, what: str = "", *, fix: str = "", max_bytes: int = MAX_BYTES,
         error: type[Exception] = UserError, **kwargs):
    """The JSON value of the file ``path``, through :func:`parse` (``kwargs``: its options); messages name the file
    as ``"<what> <path>"``. A missing path, one that is not a regular file (a directory, a device, a FIFO), one
    larger than ``max_bytes`` or unreadable is the same one line."""
    from .paths import path_kind

    p = Path(path)
    where = f"{what} {p}" if what else str(p)
    tail = f"; {fix}" if fix else ""
    kind = path_kind(p)
    if kind == "missing":
        raise error(f"{where} does not exist{tail}")
    if kind != "a regular file":
        shown = kind if kind.startswith("unreadable") else f"{kind}, not a regular file"
        raise error(f"{where} is {shown}{tail}")
    try:
        with open(p, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{where} cannot be read ({e.strerror or e}){tail}") from None
    if len(raw) > max_bytes:
        raise error(f"{where} is larger than {max_bytes >> 20} MiB, far more than a file of this kind holds{tail}")
    return parse(raw, where, fix=fix, error=error, **kwargs)


__all__ = ["MAX_BYTES", "MAX_DEPTH", "json_type_name", "parse", "read"]
