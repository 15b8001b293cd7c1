"""The architecture table of docs/guide/architectures.md, generated from the registry (a test keeps the page equal
to it).

``python -m mlx_fun.adapters.table`` prints it; ``--write docs/guide/architectures.md`` replaces the table between
the ``<!-- architectures:start -->`` / ``<!-- architectures:end -->`` markers of that file (or of any other).
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import _ADAPTERS, ALIASES, UNSUPPORTED

START, END = "<!-- architectures:start -->", "<!-- architectures:end -->"


def _routing(cls) -> str:
    """The adapter's own docstring (its first paragraph, on one line): how the family routes."""
    doc = (cls.__dict__.get("__doc__") or "").strip()
    if not doc:
        raise ValueError(f"{cls.__name__} has no docstring saying how its family routes")
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    head, sep, rest = text.partition(": ")
    return rest if sep and len(head) <= 40 else text  # drop the leading "family (...): " label


def _block(cls) -> str:
    if cls.split_router:
        return "decoder layer (`router` + `experts`)"
    return f"`{cls.block_attr}`"


def markdown() -> str:
    """The table: one row per adapter (its model types, aliases included), then the unsupported types."""
    aliases_of: dict[str, list[str]] = {}
    for alias, target in ALIASES.items():
        aliases_of.setdefault(target, []).append(alias)
    rows = ["| `model_type` | MoE block | routing and experts |", "|---|---|---|"]
    for cls in sorted(_ADAPTERS, key=lambda c: c.model_types[0].lower()):
        types = [t for mt in cls.model_types for t in (mt, *aliases_of.get(mt, []))]
        rows.append(f"| {', '.join(f'`{t}`' for t in types)} | {_block(cls)} | {_routing(cls)} |")
    for mt, reason in sorted(UNSUPPORTED.items()):
        rows.append(f"| `{mt}` | — | **not supported**: {reason} |")
    return "\n".join(rows) + "\n"


def replace_in(text: str) -> str:
    """``text`` with the table between the markers replaced by :func:`markdown`."""
    head, sep, rest = text.partition(START)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the text has no {START} ... {END} section")
    return f"{head}{START}\n{markdown()}{END}{tail}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"] and len(argv) == 2:
        path = Path(argv[1])
        path.write_text(replace_in(path.read_text()))
        return 0
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
