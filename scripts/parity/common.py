"""What the parity scripts share: the reference's Python (a PyTorch venv outside the project), the exported model,
running a script's reference side in that Python, and number-against-number printing.

A parity script runs in two processes. Its *main* side runs in the project's Python (mlx, mlx-fun): it exports the
model to transformers' layout (:mod:`scripts.tools.export_transformers`), writes the inputs (token ids) to a work
directory, runs mlx-fun, then starts its *reference* side (``python -m scripts.parity.NAME --side reference``) in the
reference's Python, which imports the reference code from ``--reference DIR`` and writes its numbers as ``.npz``;
the main side compares the two. This module imports only the standard library and numpy, so both sides can use it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
#: where a parity script's reference Python is found when ``--python`` is not given
PYTHON_ENV = "PARITY_PYTHON"


def add_common_args(p, *, work: str) -> None:
    """The options every parity script takes: ``--reference``, ``--python``, ``--model``, ``--work``,
    ``--device``, ``--side``."""
    p.add_argument("--reference", required=True, help="the reference repository's tree (its code is imported)")
    p.add_argument("--python", default=os.environ.get(PYTHON_ENV),
                   help=f"a Python with torch + transformers 4.x for the reference side (default ${PYTHON_ENV})")
    p.add_argument("--model", default=str(ROOT / "data" / "tiny-moe"), help="mlx-lm qwen3_moe model directory")
    p.add_argument("--work", default=work, help="work directory (exported model, tokens, both sides' numbers)")
    p.add_argument("--device", default="cpu", help="torch device of the reference side (cpu, cuda)")
    p.add_argument("--side", choices=("main", "reference"), default="main", help=argparse.SUPPRESS)


def exported(model: str | os.PathLike, work: Path) -> Path:
    """``work/transformers``: ``model`` in transformers' qwen3_moe layout, exported once."""
    from scripts.tools.export_transformers import export

    out = work / "transformers"
    if not (out / "model.safetensors").is_file():
        export(Path(model), out)
    return out


def sides(args, *, reference, ours) -> int:
    """A parity script's entry: ``--side reference`` (in the reference's Python) runs ``reference(args)``; otherwise
    ``ours(args)``, which starts the reference side itself, returns the exit status."""
    if args.side == "reference":
        reference(args)
        return 0
    return ours(args)


def run_reference(module: str, args, extra: list[str]) -> None:
    """Run ``python -m scripts.parity.<module> --side reference`` in ``args.python`` with the common options and
    ``extra``; its output goes to ours; a failure stops the script."""
    if not args.python:
        sys.exit(f"Error: no reference Python; pass --python (a venv with torch + transformers) or set ${PYTHON_ENV}.")
    cmd = [args.python, "-m", f"scripts.parity.{module}", "--side", "reference", "--reference", args.reference,
           "--model", args.model, "--work", args.work, "--device", args.device, *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("LD_PRELOAD", None)  # mlx-fun's fast-BLAS preload is for MLX, not torch
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"Error: the reference side failed (exit {done.returncode}): {' '.join(cmd)}")


def reference_path(reference: str | os.PathLike, *inside: str) -> None:
    """Put ``reference/<inside>`` first on ``sys.path`` (the reference side imports the reference from there)."""
    path = Path(reference, *inside).resolve()
    if not path.is_dir():
        sys.exit(f"Error: {path} is not a directory; pass the reference repository's tree as --reference.")
    sys.path.insert(0, str(path))


def write_tokens(path: Path, samples) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([list(map(int, s)) for s in samples]))


def read_tokens(path: Path) -> list[list[int]]:
    return json.loads(path.read_text())


def max_rel(ours, theirs) -> float:
    """max |ours − theirs| / |theirs| over entries (entries where the reference is 0: the absolute difference)."""
    a, b = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(a - b) / np.where(b == 0, 1.0, np.abs(b))))


def rankings_equal(ours, theirs) -> tuple[int, int]:
    """How many rows (layers) rank their entries in the same order (descending, stable), of how many."""
    a, b = np.asarray(ours), np.asarray(theirs)
    same = sum(np.array_equal(np.argsort(-x, kind="stable"), np.argsort(-y, kind="stable")) for x, y in zip(a, b))
    return int(same), len(a)


def table(header: list[str], rows: list[list]) -> None:
    """Print ``rows`` under ``header`` in aligned columns."""
    cells = [header] + [[c if isinstance(c, str) else f"{c:.6g}" for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), flush=True)
