"""The text pieces both corpus builders use (:mod:`mlx_fun.datasets.corpus` for the bundled sources, :mod:`mlx_fun.datasets.corpus_machine`
for what a machine has installed): the :class:`Document` they yield, a text file read as UTF-8 (gzip or not) and
the docstrings of a Python module.
"""

from __future__ import annotations

import ast
import gzip
from collections import deque
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    """One source document: ``group`` (else ``doc_id``) decides its split; ``text`` is chunked into samples."""

    doc_id: str
    text: str
    group: str = ""


def read_text(path: Path) -> str:
    """A text file, gzip-compressed (``.gz``) or not, as UTF-8 (undecodable bytes replaced)."""
    raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


_HOLDS_DEFS = (ast.stmt, ast.excepthandler, ast.match_case)


def docstrings(source: str) -> list[str]:
    """The docstrings (≥ 80 characters) of a module, its classes and functions, in ``ast.walk``'s order. The walk
    only enters statements (and except / case clauses), where definitions live: the same order as walking every
    node (breadth first, depths kept), without visiting the expressions, which are most of a tree."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _HOLDS_DEFS))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 80:
                out.append(doc)
    return out
