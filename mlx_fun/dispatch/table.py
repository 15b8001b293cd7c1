"""The dispatch cut-off table: plans, layer keys, table entries (bands of M → plan), and table files.

A table maps ``(backend, quantization, D, H, E, k)`` to *bands*: from a token count M on, which plan runs the
experts (see :mod:`mlx_fun.dispatch.experts` for the plans themselves). Lookup is the exact key, else the nearest entry
of the same backend and weight class (float or quantized), else mlx-lm's own rule. Tables come from the shipped
``mlx_fun/dispatch/dispatch_table.json``, the user table written by ``mlx-fun tune-dispatch`` (``$MLX_FUN_DISPATCH_TABLE``,
default ``~/.cache/mlx-fun/dispatch_table.json``) and an explicit path, later ones taking precedence.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterable

import mlx.core as mx
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

TABLE_VERSION = 1
#: mlx-lm's SwitchGLU sorts when ``indices.size >= MLX_LM_SORT_SIZE``
MLX_LM_SORT_SIZE = 64
TABLE_ENV = "MLX_FUN_DISPATCH_TABLE"
SHIPPED_TABLE = "dispatch_table.json"


# --------------------------------------------------------------------------------------------------- plans


#: the block sizes R a ``blocked<R>`` plan may have: a call pads each expert's rows to a multiple of R (up to
#: E·(R−1) padding rows: 65k rows for 256 experts at R = 256; a table's ``blocked1000000`` grew smoke-test to
#: 7.4 GB in 24 s); tune-dispatch tries 8 to 64 by default
BLOCK_RANGE = (1, 256)


def check_block(block: int, plan: str) -> None:
    """A one-line ``ValueError`` unless ``block`` is in :data:`BLOCK_RANGE` (``plan``: how the plan was written)."""
    low, high = BLOCK_RANGE
    if not low <= block <= high:
        raise ValueError(f"{plan!r} has blocks of R = {block} rows; blocked<R> takes R from {low} to {high} (each "
                         f"expert's rows are padded to a multiple of R)")


@dataclass(frozen=True)
class Plan:
    """One way to run the experts: ``layout`` unsorted / sorted / blocked (with ``block`` rows, in
    :data:`BLOCK_RANGE`), ``dequant``."""

    layout: str
    block: int = 0
    dequant: bool = False

    @classmethod
    def parse(cls, text: str) -> "Plan":
        s = str(text).strip()
        if s == "mlx-lm":
            return cls("mlx-lm")
        dequant = s.startswith("dequant:")
        if dequant:
            s = s[len("dequant:"):]
        if s in ("unsorted", "sorted"):
            return cls(s, 0, dequant)
        if s.startswith("blocked"):
            try:
                block = int(s[len("blocked"):])
            except ValueError:
                block = 0
            if block >= 1:
                check_block(block, str(text).strip())
                return cls("blocked", block, dequant)
        raise ValueError(
            f"unknown dispatch plan {text!r} (mlx-lm, unsorted, sorted, blocked<R>; 'dequant:' before the last three)"
        )

    def __str__(self) -> str:
        name = f"blocked{self.block}" if self.layout == "blocked" else self.layout
        return f"dequant:{name}" if self.dequant else name

    @property
    def native(self) -> "Plan":
        """The same layout on the stored (possibly quantized) weights."""
        return Plan(self.layout, self.block, False)


UNSORTED = Plan("unsorted")
SORTED = Plan("sorted")
#: follow mlx-lm's rule (resolved per call to UNSORTED or SORTED)
MLX_LM = Plan("mlx-lm")


def mlx_lm_plan(m: int, k: int) -> Plan:
    """What mlx-lm's SwitchGLU does for M tokens with top-k: sort when ``M·k >= 64``."""
    return SORTED if m * k >= MLX_LM_SORT_SIZE else UNSORTED


def mlx_lm_bands() -> list[tuple[int, Plan]]:
    """mlx-lm's rule as bands: one band from M = 1 that follows it."""
    return [(1, MLX_LM)]


def plan_for(bands: list[tuple[int, Plan]], m: int) -> Plan:
    """The plan of the last band whose ``from`` is <= m (bands sorted by ``from``, the first from 1)."""
    chosen = bands[0][1]
    for start, plan in bands:
        if m >= start:
            chosen = plan
        else:
            break
    return chosen


# ---------------------------------------------------------------------------------------------------- keys


def backend_name(device=None) -> str:
    """``cpu``, ``cuda``, ``metal`` (or ``gpu``) for the default (or given) device."""
    dev = device if device is not None else mx.default_device()
    if dev.type == mx.cpu:
        return "cpu"
    try:
        if mx.cuda.is_available():
            return "cuda"
    except Exception:
        pass
    try:
        if mx.metal.is_available():
            return "metal"
    except Exception:
        pass
    return "gpu"


def dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def quant_key(proj) -> str:
    """``float32``/``bfloat16``/``float16`` for float experts; quantized: ``affine<bits>-g<group_size>``, or
    ``<mode>-g<group_size>`` for the fixed-width modes (``mxfp4-g32``, ``nvfp4-g16``, ``mxfp8-g32``)."""
    if isinstance(proj, QuantizedSwitchLinear):
        return quant_name(proj.mode, proj.bits, proj.group_size)
    return dtype_name(proj.weight.dtype)


def quant_name(mode: str, bits: int, group_size: int) -> str:
    if mode == "affine":
        return f"affine{bits}-g{group_size}"
    return f"{mode}-g{group_size}"


def is_quant_key(key: str) -> bool:
    return not key.startswith(("float", "bfloat"))


@dataclass(frozen=True)
class LayerKey:
    """What a table entry is keyed by, less the backend and k (known at call time)."""

    quant: str
    D: int
    H: int
    E: int

    @classmethod
    def of(cls, experts) -> "LayerKey":
        up = experts.up_proj
        return cls(quant_key(up), int(up.input_dims), int(up.output_dims), int(up.num_experts))


# --------------------------------------------------------------------------------------------------- table


def _bad(where: str, want: str, value) -> ValueError:
    from ..datasets.samples import json_type_name

    return ValueError(f"{where} must be {want}, got {json_type_name(value)} {json.dumps(value)[:60]}")


def _parse_bands(raw, where: str = "bands") -> list[tuple[int, Plan]]:
    """Bands from their JSON (a non-empty list of ``{"from": M, "plan": ...}``, the first from M = 1); a
    ``ValueError`` naming ``where`` (``entries[3].bands[0].plan``) for any other shape."""
    from ..datasets.samples import json_whole

    if not isinstance(raw, list):
        raise _bad(where, 'a list of {"from": M, "plan": ...} bands', raw)
    if not raw:
        raise ValueError(f"{where} needs at least one band")
    bands = []
    for i, band in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(band, dict):
            raise _bad(at, 'an object {"from": M, "plan": ...}', band)
        if not json_whole(band.get("from"), 1):
            raise _bad(f"{at}.from", "a whole number >= 1", band.get("from"))
        if not isinstance(band.get("plan"), str):
            raise _bad(f"{at}.plan", "a string", band.get("plan"))
        try:
            bands.append((band["from"], Plan.parse(band["plan"])))
        except ValueError as e:
            raise ValueError(f"{at}.plan: {e}") from None
    bands.sort(key=lambda t: t[0])
    if bands[0][0] > 1:
        raise ValueError(f"the first band of {where} must start at M = 1")
    return bands


def bands_to_json(bands: list[tuple[int, Plan]]) -> list[dict]:
    return [{"from": int(start), "plan": str(plan)} for start, plan in bands]


@dataclass
class Entry:
    """One measured cut-off table entry (or mlx-lm's rule, ``source == "mlx-lm rule"``)."""

    backend: str
    quant: str
    D: int
    H: int
    E: int
    k: int
    bands: list[tuple[int, Plan]]
    bands_cached: list[tuple[int, Plan]] | None = None
    source: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.backend, self.quant, self.D, self.H, self.E, self.k)

    def plan(self, m: int, cached: bool = False) -> Plan:
        bands = self.bands_cached if cached and self.bands_cached else self.bands
        return plan_for(bands, m)

    def uses_dequant(self, cached: bool) -> bool:
        bands = self.bands_cached if cached and self.bands_cached else self.bands
        return any(plan.dequant for _, plan in bands)

    @classmethod
    def from_json(cls, obj: dict, source: str = "", where: str = "the entry") -> "Entry":
        """An entry from its JSON; a ``ValueError`` naming ``where`` and the field for any malformed one."""
        from ..datasets.samples import json_whole

        if not isinstance(obj, dict):
            raise _bad(where, "an object (backend, quant, D, H, E, k, bands)", obj)
        missing = [key for key in ("backend", "quant", "D", "H", "E", "k", "bands") if key not in obj]
        if missing:
            raise ValueError(f"{where} has no {', '.join(repr(k) for k in missing)}")
        for key in ("backend", "quant"):
            if not isinstance(obj[key], str) or not obj[key]:
                raise _bad(f"{where}.{key}", "a non-empty string", obj[key])
        for key in ("D", "H", "E", "k"):
            if not json_whole(obj[key], 1):
                raise _bad(f"{where}.{key}", "a whole number >= 1", obj[key])
        if obj["k"] > obj["E"]:
            raise ValueError(f"{where}.k ({obj['k']}) must not exceed its E ({obj['E']})")
        known = {"backend", "quant", "D", "H", "E", "k", "bands", "bands_cached"}
        cached = obj.get("bands_cached")
        return cls(
            backend=obj["backend"], quant=obj["quant"], D=obj["D"], H=obj["H"], E=obj["E"], k=obj["k"],
            bands=_parse_bands(obj["bands"], f"{where}.bands"),
            bands_cached=_parse_bands(cached, f"{where}.bands_cached") if cached not in (None, []) else None,
            source=source,
            extra={key: v for key, v in obj.items() if key not in known},
        )

    def to_json(self) -> dict:
        out = {"backend": self.backend, "quant": self.quant, "D": self.D, "H": self.H, "E": self.E, "k": self.k,
               "bands": bands_to_json(self.bands)}
        if self.bands_cached:
            out["bands_cached"] = bands_to_json(self.bands_cached)
        out.update(self.extra)
        return out

    def describe(self) -> str:
        where = f" [{self.source}]" if self.source else ""
        if self.source == "mlx-lm rule":
            return f"mlx-lm rule (sort when M*k >= {MLX_LM_SORT_SIZE})"
        bands = ", ".join(f"M>={s}:{p}" for s, p in self.bands)
        return f"{self.backend} {self.quant} D{self.D} H{self.H} E{self.E} k{self.k}{where}: {bands}"


def default_entry(backend: str, key: LayerKey, k: int) -> Entry:
    return Entry(backend, key.quant, key.D, key.H, key.E, k, mlx_lm_bands(), None, "mlx-lm rule")


def _log_dist(a: int, b: int) -> float:
    return abs(math.log2(max(a, 1) / max(b, 1)))


class Table:
    """Cut-off entries, later-added ones taking precedence for the same key."""

    def __init__(self, entries: Iterable[Entry] = (), sources: Iterable[str] = ()):
        self._entries: dict[tuple, Entry] = {}
        self.sources: list[str] = list(sources)
        for e in entries:
            self.add(e)

    def add(self, entry: Entry) -> None:
        self._entries.pop(entry.key, None)  # re-insert so that later additions rank first among ties
        self._entries[entry.key] = entry

    @property
    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def backends(self) -> list[str]:
        return sorted({e.backend for e in self._entries.values()})

    def lookup(self, backend: str, key: LayerKey, k: int | None) -> tuple[Entry, str]:
        """``(entry, how)`` with how = ``exact``, ``nearest`` or ``default`` (mlx-lm's rule)."""
        if k is not None:
            exact = self._entries.get((backend, key.quant, key.D, key.H, key.E, k))
            if exact is not None:
                return exact, "exact"
        want_quant = is_quant_key(key.quant)
        best, best_score = None, None
        for rank, e in enumerate(reversed(list(self._entries.values()))):
            if e.backend != backend or is_quant_key(e.quant) != want_quant:
                continue
            score = 0.0 if e.quant == key.quant else 2.0
            score += _log_dist(e.D, key.D) + _log_dist(e.H, key.H) + _log_dist(e.E, key.E)
            if k is not None:
                score += _log_dist(e.k, k)
            if best_score is None or score < best_score - 1e-12:
                best, best_score = e, score
        if best is None:
            return default_entry(backend, key, k or 1), "default"
        if k is not None and best.k == k and best.quant == key.quant and (best.D, best.H, best.E) == (key.D, key.H, key.E):
            return best, "exact"
        return best, "nearest"

    # ----- files
    @classmethod
    def from_json(cls, obj: dict, source: str = "") -> "Table":
        """A table from its JSON; a ``ValueError`` naming the field for any malformed shape."""
        if not isinstance(obj, dict):
            raise _bad("the table", 'a JSON object {"version": 1, "entries": [...]}', obj)
        version = obj.get("version", TABLE_VERSION)
        if version != TABLE_VERSION:
            raise ValueError(f"dispatch table version {version} is not supported (expected {TABLE_VERSION})")
        entries = obj.get("entries", [])
        if not isinstance(entries, list):
            raise _bad("'entries'", "a list of entries", entries)
        return cls((Entry.from_json(e, source, f"entries[{i}]") for i, e in enumerate(entries)),
                   [source] if source else [])

    def to_json(self) -> dict:
        return {"version": TABLE_VERSION, "entries": [e.to_json() for e in self.entries]}

    def merged(self, other: "Table") -> "Table":
        """A new table: this one's entries, then ``other``'s (which win for the same key)."""
        return Table(self.entries + other.entries, self.sources + other.sources)


#: the largest table file read (tables are a few kB; this bounds what a wrong path, say a device, can cost)
MAX_TABLE_BYTES = 16 << 20


def read_table(path: str | os.PathLike) -> Table:
    """Read a table file; a missing, unreadable or malformed file raises a one-line ``ValueError`` naming the
    file and the problem (no fix: callers add the one that fits them)."""
    from ..core import json_input

    p = Path(path)
    obj = json_input.read(p, "dispatch table", max_bytes=MAX_TABLE_BYTES, error=ValueError)
    try:
        return Table.from_json(obj, source=str(p))
    except ValueError as e:
        raise ValueError(f"dispatch table {p} is malformed: {e}") from None


def shipped_table() -> Table:
    text = resources.files("mlx_fun.dispatch").joinpath(SHIPPED_TABLE).read_text()
    return Table.from_json(json.loads(text), source="shipped")


def user_table_path() -> Path:
    """Where ``tune-dispatch`` writes by default and ``--dispatch auto`` looks: ``$MLX_FUN_DISPATCH_TABLE``,
    else ``$XDG_CACHE_HOME/mlx-fun/dispatch_table.json`` (``~/.cache`` when unset)."""
    env = os.environ.get(TABLE_ENV)
    if env:
        return Path(env).expanduser()
    from ..core.paths import cache_root

    return cache_root() / "dispatch_table.json"


def load_table(table_path: str | os.PathLike | None = None, user: bool = True) -> Table:
    """The shipped table, overlaid by the user table (if it exists) and by ``table_path`` (if given). A bad file is
    a one-line ``ValueError`` naming it, the problem and the fix."""
    from ..errors import param

    table = shipped_table()
    reads = []
    if user and user_table_path().is_file():
        reads.append((user_table_path(), f"fix or delete this user table (mlx-fun tune-dispatch writes it; "
                                         f"{TABLE_ENV} names another file)"))
    if table_path is not None:
        reads.append((table_path, f"fix the file or drop {param('dispatch_table')}"))
    for path, fix in reads:
        try:
            table = table.merged(read_table(path))
        except ValueError as e:
            raise ValueError(f"{e}; {fix}.") from None
    return table


#: the marker (under the cache root) that this machine was told once that ``backend`` has no measured entry
UNTUNED_MARKER = "untuned-{backend}.told"


def untuned_line(backend: str) -> str:
    return (f"dispatch: no measured cut-offs for {backend} yet, so mlx-lm's rule runs the experts; "
            f"`mlx-fun tune-dispatch --model <model>` measures them for this machine (about 30 s to a few minutes "
            f"per expert shape) and every later command uses them.")


def has_backend(table: Table, backend: str) -> bool:
    return any(e.backend == backend for e in table.entries)


def untuned_notice(backend: str) -> str | None:
    """:func:`untuned_line` the first time it is asked for on this machine (a marker file in the cache root;
    None afterwards, and None when the marker cannot be written: better silent than repeated)."""
    from ..core.paths import cache_root

    marker = cache_root() / UNTUNED_MARKER.format(backend=backend)
    if marker.exists():
        return None
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        return None
    return untuned_line(backend)


def table_text(table: Table) -> str:
    """The table as JSON text: one entry key per line, each band and each list of numbers on one line."""

    def dump(value, indent: int) -> str:
        pad, inner = " " * indent, " " * (indent + 2)
        if isinstance(value, dict):
            flat = all(not isinstance(v, (dict, list)) for v in value.values())
            if flat and len(value) <= 3:
                return json.dumps(value)
            items = [f"{inner}{json.dumps(k)}: {dump(v, indent + 2)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(value, list):
            if all(not isinstance(v, (dict, list)) for v in value):
                return json.dumps(value)
            items = [f"{inner}{dump(v, indent + 2)}" for v in value]
            return "[\n" + ",\n".join(items) + f"\n{pad}]"
        return json.dumps(value)

    return dump(table.to_json(), 0) + "\n"


def write_table(table: Table, path: str | os.PathLike, *, force: bool = False) -> None:
    """Write ``table`` to ``path`` atomically (an existing file only with ``force``)."""
    from ..core.writer import write_text

    write_text(path, table_text(table), force=force)


def merge_table_files(sources: Iterable[str | os.PathLike], into: str | os.PathLike) -> Table:
    """Merge the entries of ``sources`` into the table file ``into`` (created if missing; merging into it is what
    is asked, so an existing one is replaced by the merge), atomically."""
    target = Path(into)
    table = read_table(target) if target.is_file() else Table()
    for src in sources:
        table = table.merged(read_table(src))
    write_table(table, target, force=True)
    return table
