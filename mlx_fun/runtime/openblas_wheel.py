"""A fast BLAS from PyPI for MLX's CPU backend on Linux, with no system package.

The ``mlx[cpu]`` wheel links the slow reference (netlib) BLAS. PyPI's ``scipy-openblas32`` (the OpenBLAS that
SciPy and NumPy ship: LP64, pthreads, x86_64 and aarch64 manylinux wheels) is fast, but every symbol carries a
``scipy_`` prefix (``scipy_cblas_sgemm``) so that it never clashes with another BLAS, which also means
``LD_PRELOAD`` cannot put it under MLX. :func:`prepared_library` makes a renamed copy once, in mlx-fun's cache:

- each dynamic symbol named ``scipy_X`` is renamed ``X`` by pointing its name at the suffix of the same
  string in ``.dynstr`` (``"scipy_cblas_sgemm\\0"`` already contains ``"cblas_sgemm\\0"``), so no string moves;
- the GNU hash table, which is keyed by name and orders the symbols by bucket, is replaced in place by a SysV
  hash table (``DT_HASH``, any symbol order) written into the same bytes, and the dynamic tag is switched.

Nothing else in the file changes. The copy is checked before it is used: it must load, export ``cblas_sgemm``
and ``sgemm_``, and compute a small single-precision product correctly through both. The copy is keyed by the
wheel's version and the source file's size and mtime, so an upgraded wheel gets a new copy.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from pathlib import Path

PACKAGE = "scipy_openblas32"
PREFIX = b"scipy_"
_DT_NULL, _DT_HASH, _DT_STRTAB, _DT_SYMTAB, _DT_GNU_HASH = 0, 4, 5, 6, 0x6FFFFEF5
_PT_LOAD, _PT_DYNAMIC = 1, 2
_SHT_HASH, _SHT_GNU_HASH = 5, 0x6FFFFFF6


class PatchError(Exception):
    """The library does not have the layout this renaming handles (it is then simply not used)."""


def wheel_library() -> Path | None:
    """``libscipy_openblas.so`` of the installed ``scipy-openblas32`` wheel, or None (found without importing it)."""
    from importlib.util import find_spec

    try:
        spec = find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        lib = Path(root) / "lib" / "libscipy_openblas.so"
        if lib.is_file():
            return lib
    return None


def cache_dir() -> Path:
    from ..core.paths import cache_root

    return cache_root() / "blas"


def _elf_hash(name: bytes) -> int:
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


def strip_symbol_prefix(data: bytes, prefix: bytes = PREFIX) -> bytes:
    """The shared library ``data`` with every dynamic symbol ``prefix + X`` renamed ``X`` (see the module doc)."""
    b = bytearray(data)
    if b[:4] != b"\x7fELF" or b[4] != 2 or b[5] != 1:
        raise PatchError("not a 64-bit little-endian ELF file")
    e_phoff, e_shoff = struct.unpack_from("<QQ", b, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", b, 0x36)
    phs = [struct.unpack_from("<IIQQQQQQ", b, e_phoff + i * e_phentsize) for i in range(e_phnum)]
    loads = [p for p in phs if p[0] == _PT_LOAD]

    def offset(vaddr: int) -> int:
        for _, _, p_offset, p_vaddr, _, p_filesz, _, _ in loads:
            if p_vaddr <= vaddr < p_vaddr + p_filesz:
                return vaddr - p_vaddr + p_offset
        raise PatchError(f"address {vaddr:#x} is in no loaded segment")

    dyn = next((p for p in phs if p[0] == _PT_DYNAMIC), None)
    if dyn is None:
        raise PatchError("no dynamic section")
    tags: dict[int, tuple[int, int]] = {}
    pos = dyn[2]
    while True:
        tag, val = struct.unpack_from("<qQ", b, pos)
        tags.setdefault(tag, (pos, val))
        pos += 16
        if tag == _DT_NULL:
            break
    if _DT_GNU_HASH not in tags or _DT_HASH in tags:
        raise PatchError("expected a GNU hash table and no SysV one")
    gh, symtab, strtab = (offset(tags[t][1]) for t in (_DT_GNU_HASH, _DT_SYMTAB, _DT_STRTAB))

    nbuckets, symoffset, bloom_size, _ = struct.unpack_from("<IIII", b, gh)
    buckets_at = gh + 16 + 8 * bloom_size
    chains_at = buckets_at + 4 * nbuckets
    last = max(struct.unpack_from(f"<{nbuckets}I", b, buckets_at))
    if last < symoffset:
        raise PatchError("empty GNU hash table")
    while not struct.unpack_from("<I", b, chains_at + 4 * (last - symoffset))[0] & 1:
        last += 1
    nsyms = last + 1
    gh_size = chains_at + 4 * (nsyms - symoffset) - gh

    names = []
    for i in range(nsyms):
        at = symtab + 24 * i
        st_name = struct.unpack_from("<I", b, at)[0]
        start = strtab + st_name
        name = bytes(b[start:b.index(b"\0", start)])
        if name.startswith(prefix):
            name = name[len(prefix):]
            struct.pack_into("<I", b, at, st_name + len(prefix))
        names.append(name)
    if len(set(n for n in names if n)) != len([n for n in names if n]):
        raise PatchError("renaming would make two symbols share a name")

    nbucket = min(nsyms, (gh_size - 8 - 4 * nsyms) // 4)
    if nbucket < 1:
        raise PatchError("no room for a SysV hash table")
    bucket, chain = [0] * nbucket, [0] * nsyms
    for i in range(1, nsyms):
        h = _elf_hash(names[i]) % nbucket
        chain[i], bucket[h] = bucket[h], i
    b[gh:gh + gh_size] = bytes(gh_size)
    struct.pack_into(f"<II{nbucket}I{nsyms}I", b, gh, nbucket, nsyms, *bucket, *chain)
    struct.pack_into("<q", b, tags[_DT_GNU_HASH][0], _DT_HASH)
    for i in range(e_shnum if e_shoff else 0):  # keep readelf/objdump's view consistent (the loader ignores it)
        at = e_shoff + i * e_shentsize
        if struct.unpack_from("<I", b, at + 4)[0] == _SHT_GNU_HASH:
            struct.pack_into("<I", b, at + 4, _SHT_HASH)
            struct.pack_into("<Q", b, at + 56, 4)  # sh_entsize
    return bytes(b)


def verify(path: str | os.PathLike) -> str | None:
    """None if ``path`` loads and computes a 2×3 · 3×2 product right through ``cblas_sgemm`` and ``sgemm_``;
    else the reason."""
    try:
        lib = ctypes.CDLL(os.fspath(path))
    except OSError as e:
        return f"cannot be loaded ({e})"
    for sym in ("cblas_sgemm", "sgemm_"):
        if not hasattr(lib, sym):
            return f"does not export {sym}"
    a = (ctypes.c_float * 6)(1, 2, 3, 4, 5, 6)  # row-major 2×3
    bm = (ctypes.c_float * 6)(7, 8, 9, 10, 11, 12)  # row-major 3×2
    want = [58.0, 64.0, 139.0, 154.0]
    c = (ctypes.c_float * 4)()
    f = ctypes.c_float
    lib.cblas_sgemm(101, 111, 111, 2, 2, 3, f(1.0), a, 3, bm, 2, f(0.0), c, 2)  # RowMajor, NoTrans, NoTrans
    if list(c) != want:
        return f"cblas_sgemm computed {list(c)} instead of {want}"
    # Fortran sgemm_ is column-major: C^T = B^T A^T, i.e. the same buffers as (2×2) = (2×3)(3×2) transposed.
    c2 = (ctypes.c_float * 4)()
    i = ctypes.c_int
    ta = ctypes.c_char(b"N")
    lib.sgemm_(ctypes.byref(ta), ctypes.byref(ta), ctypes.byref(i(2)), ctypes.byref(i(2)), ctypes.byref(i(3)),
               ctypes.byref(f(1.0)), bm, ctypes.byref(i(2)), a, ctypes.byref(i(3)), ctypes.byref(f(0.0)), c2,
               ctypes.byref(i(2)))
    if list(c2) != want:
        return f"sgemm_ computed {list(c2)} instead of {want}"
    return None


def prepared_library() -> tuple[Path | None, str | None]:
    """``(path, None)`` of a verified, renamed copy of the wheel's OpenBLAS (made on first use), or
    ``(None, reason)``: the wheel is not installed, or the copy could not be made or failed its check."""
    src = wheel_library()
    if src is None:
        return None, f"the {PACKAGE.replace('_', '-')} wheel is not installed"
    from importlib import metadata

    try:
        version = metadata.version(PACKAGE.replace("_", "-"))
    except metadata.PackageNotFoundError:
        version = "unknown"
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = cache_dir() / f"libopenblas-{PACKAGE}-{version}-{key}.so"
    if dest.is_file():
        return dest, None
    try:
        data = strip_symbol_prefix(src.read_bytes())
    except (PatchError, OSError, struct.error) as e:
        return None, f"{src} could not be prepared ({e})"
    from ..errors import UserError
    from ..core.writer import output

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with output(dest, kind="file", flag="the BLAS cache") as res:
            res.tmp.write_bytes(data)
            reason = verify(res.tmp)
            if reason is not None:
                raise PatchError(reason)
    except (PatchError, UserError, OSError) as e:
        return None, f"the renamed copy of {src} in {dest.parent} failed: {e}"
    return dest, None
