"""Byte sizes as people write them (``512MB``, ``4GiB``, ``1.5G``) and back: shared by the dispatch's
``--dequant-cache`` and the writer's ``--max-shard-size``, so neither imports the other."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^([0-9]*\.?[0-9]+)([kmgt]?)(i?b)?$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def parse_bytes(text: str | int) -> int:
    """``0``, ``512MB``, ``4GiB``, ``1.5G``, ``1048576`` → bytes (K/M/G/T are powers of 1024)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a byte size must be >= 0, got {text}")
        return text
    match = _SIZE.match(str(text).strip().lower().replace(" ", ""))
    if match is None:
        raise ValueError(f"not a byte size: {text!r} (e.g. 0, 512MB, 4GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
