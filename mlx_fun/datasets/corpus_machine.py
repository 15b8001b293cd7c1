"""Corpus sources read from what a machine has installed (package managers only, never a hub): third-party Python
packages (their source and their docstrings), man pages and Debian package documentation.

Each reader yields :class:`mlx_fun.datasets.corpus_text.Document` objects whose ``group`` decides the split, so everything of one
package (one man page, one Debian package's docs) lands in one split: held-out text is never a sibling file of
trained text. Caps keep a machine with gigabytes of site-packages to a corpus a run can tokenize: at most
:data:`MAX_FILE_BYTES` per source file and :data:`MAX_PACKAGE_BYTES` of code per package. What a machine has
differs, so the manifest names every package, directory and cap a build read (:func:`describe`).
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from .corpus_text import Document, docstrings, read_text

#: larger source files are generated tables or vendored bundles, not prose or code people write
MAX_FILE_BYTES = 200_000
#: code read per top-level package (torch alone would otherwise be most of the corpus)
MAX_PACKAGE_BYTES = 4_000_000
#: top-level names skipped: the toolkit itself, packaging machinery, and packages of mostly generated code
SKIP_PACKAGES = {"mlx_fun", "pip", "setuptools", "_distutils_hack", "pkg_resources", "wheel", "__pycache__",
                 "nvidia", "cupy_backends", "tests", "test"}
MAN_ROOT = Path("/usr/share/man")
DOC_ROOT = Path("/usr/share/doc")
_DOC_NAMES = re.compile(r"^(README|NEWS|FAQ|TODO|HOWTO|USAGE|INSTALL|CONTRIBUTING|AUTHORS)|\.(txt|md|rst|markdown)$",
                        re.I)


def site_dirs() -> list[Path]:
    """The interpreter's site-packages directories (pure and platform), existing ones, without duplicates."""
    out: list[Path] = []
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key])
        if p.is_dir() and p not in out:
            out.append(p)
    return out


def packages() -> list[tuple[str, Path]]:
    """(top-level name, directory) of every importable package directory in site-packages, sorted by name."""
    found: dict[str, Path] = {}
    for root in site_dirs():
        for entry in sorted(root.iterdir()):
            name = entry.name
            if (entry.is_dir() and name.isidentifier() and name not in SKIP_PACKAGES and not name.startswith("_")
                    and (entry / "__init__.py").exists()):
                found.setdefault(name, entry)
    return sorted(found.items())


def _package_files(top: Path) -> Iterator[Path]:
    """A package's .py files, tests and generated bundles left out, at most MAX_PACKAGE_BYTES in path order."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in {"tests", "test", "testing", "_vendor", "vendor",
                                                              "__pycache__"} and not d.startswith("."))
        for f in sorted(filenames):
            path = Path(dirpath) / f
            if not f.endswith(".py") or f.startswith("test_"):
                continue
            size = path.stat().st_size
            if size == 0 or size > MAX_FILE_BYTES:
                continue
            if total + size > MAX_PACKAGE_BYTES:
                return
            total += size
            yield path


def package_code_documents() -> Iterator[Document]:
    """Every kept source file of every package; the group is the package."""
    for name, top in packages():
        for path in _package_files(top):
            text = read_text(path)
            if text.strip():
                yield Document(f"pkg:{name}/{path.relative_to(top).as_posix()}", text, f"pkg:{name}")


def package_doc_documents() -> Iterator[Document]:
    """The docstrings of each kept source file, in the same groups as its code."""
    for doc in package_code_documents():
        docs = docstrings(doc.text)
        if docs:
            yield Document(doc.doc_id, "\n\n".join(docs), doc.group)


# ------------------------------------------------------------------------------------------- man pages
_TROFF_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d+"), ""),  # size changes
    (re.compile(r"\\\*\((..)|\\\*\[([^\]]*)\]|\\\*(.)"), ""),  # strings
    (re.compile(r"\\\((em|en)"), "-"),
    (re.compile(r"\\\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\((oq|cq|aq)"), "'"),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\[&|^%:!c]"), ""),
    (re.compile(r"\\[hvwzkoCNXYDlLbx]'[^']*'"), ""),
    (re.compile(r"\\ "), " "),
]
_TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "BI", "IB", "IR", "RB", "RI", "SM", "SB", "TP", "IP", "OP", "Nm", "Nd",
                "Ar", "Fl", "Op", "Pa", "Xr", "Sh", "Ss", "Dt", "Em", "Sy", "Li", "Ql", "Cm", "Ic", "Va", "Ev"}


def troff_text(source: str) -> str:
    """A man page's troff source as plain text: comments, definitions and layout requests go, the arguments of
    text macros (headings, bold, italics, tagged paragraphs) stay, escapes become characters or nothing."""
    out: list[str] = []
    skipping = False
    for line in source.splitlines():
        if skipping:
            skipping = line.strip() != ".."
            continue
        if line.startswith((".de ", ".de\t", ".ig")):
            skipping = True
            continue
        if line.startswith(("'", '.\\"', "\\{", "\\}", ".\\}")):
            continue
        if line.startswith("."):
            parts = line[1:].strip().split(None, 1)
            if not parts:
                continue
            if parts[0] in _TEXT_MACROS and len(parts) > 1:
                line = parts[1].replace('"', "")
                if parts[0] in ("SH", "Sh"):
                    out.append("")
            else:
                if parts[0] in ("PP", "LP", "P", "sp", "Pp"):
                    out.append("")
                continue
        if "\\" in line:  # every escape starts with one; most lines have none (1.8x faster over /usr/share/man)
            for pattern, repl in _TROFF_ESCAPES:
                line = pattern.sub(repl, line)
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def man_documents(root: Path = MAN_ROOT) -> Iterator[Document]:
    """English man pages (``man<N>/``, not the translations), one document a page."""
    for section in sorted(root.glob("man*")):
        for path in sorted(section.iterdir()):
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = troff_text(read_text(path))
            if text.startswith(".so") or len(text) < 200:  # a link to another page, or nearly empty
                continue
            yield Document(f"man:{section.name}/{path.name}", text, f"man:{path.name.split('.')[0]}")


def debian_doc_documents(root: Path = DOC_ROOT) -> Iterator[Document]:
    """READMEs, NEWS, FAQs and text / Markdown / reStructuredText files of installed Debian packages (compressed
    or not); the group is the package."""
    for pkg, path in _debian_doc_files(root):
        text = read_text(path)
        if "\x00" not in text and len(text) >= 200:
            yield Document(f"debdoc:{path.relative_to(root).as_posix()}", text, f"debdoc:{pkg.name}")


def _debian_doc_files(root: Path) -> Iterator[tuple[Path, Path]]:
    """(package directory, file) of every documentation file under ``root`` a build would read."""
    if not root.is_dir():
        return
    for pkg in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(p for p in pkg.rglob("*") if p.is_file()):
            name = path.name[:-3] if path.name.endswith(".gz") else path.name
            if _DOC_NAMES.search(name) and path.stat().st_size <= MAX_FILE_BYTES:
                yield pkg, path


def available() -> dict[str, bool]:
    return {
        "packages": bool(packages()),
        "packagedocs": bool(packages()),
        "manpages": any(MAN_ROOT.glob("man*/*")),
        "debdocs": any(True for _ in _debian_doc_files(DOC_ROOT)),
    }


def describe() -> dict:
    """What a build on this machine reads: package names, directories and caps (for the manifest)."""
    return {"site_packages": [str(d) for d in site_dirs()], "packages": [name for name, _ in packages()],
            "max_file_bytes": MAX_FILE_BYTES, "max_package_bytes": MAX_PACKAGE_BYTES,
            "skipped_packages": sorted(SKIP_PACKAGES), "man_root": str(MAN_ROOT), "doc_root": str(DOC_ROOT)}
