"""Expert-list files (``--expert-list``) and the safety / domain reports that protect or target experts.

Expert list (``mlx-fun prune --expert-list``, exported by the UI as ``filtered_experts.json`` / ``.csv``)
--------------------------------------------------------------------------------------------------------
JSON::

    {
      "format": "mlx-fun-expert-list",      # required, exactly this string
      "version": 1,                          # optional, default 1; only 1 is understood
      "mode": "prune",                       # optional: "prune" or "merge"; informational
      "model_type": "qwen3_moe",             # optional; informational
      "num_experts": 64,                     # optional; when present it must equal the model's expert count
      "layers": {                            # required; keys are DECODER-LAYER indices, as strings
        "0": {"remove": [3, 17, 42]},        # either the experts to remove ...
        "1": {"keep": [0, 1, 2, 5]}          # ... or the experts to keep: exactly one of the two per layer
      }
    }

Each layer entry is an object with exactly one key, ``"remove"`` or ``"keep"``, whose value is a list of
distinct integer expert indices in ``0 .. num_experts-1``. Layer keys must be MoE layers of the model and
appear once. MoE layers absent from ``"layers"`` keep all their experts.

CSV (UTF-8; a header line, then one row per expert; blank lines and lines starting with ``#`` are ignored)::

    layer,expert,action
    0,3,remove
    0,17,remove
    1,0,keep

``layer`` is the decoder-layer index, ``expert`` the expert index, ``action`` is ``remove`` or ``keep``
(case-insensitive). All rows of one layer must have the same action; a ``(layer, expert)`` pair may appear
once. Layers without rows keep all their experts. Errors name the file and, for CSV, the line number.

mlx-lm models hold one expert count for all layers, so a pruned model must keep the same number of experts in
every MoE layer: :func:`check_keep_counts` (which the CLI runs on every kept map) rejects lists that do not —
in practice an expert list names every MoE layer, removing the same number from each.

Report schemas read by :func:`load_report_experts` (the minimum; other keys are ignored)
------------------------------------------------------------------------------------------
``safety_report.json`` (``mlx-fun safety-scan``)::

    {"safety_critical": {"<decoder layer>": [experts...]},   # used when present
     "hcdg": {"<decoder layer>": [...]}, "hrcg": {"<decoder layer>": [...]}}   # else the union of these two
    # steering's safe / unsafe modes read "hcdg", and rank its experts by "scores"."<ranked_by>" when present

``domain_report.json`` (``mlx-fun domain-scan``)::

    {"domain_experts": {"<decoder layer>": [experts...]},
     "general_experts": {"<decoder layer>": [...]}}   # optional; read by steering's `suppress` mode

Sets from several reports (e.g. safety protect + domain protect) merge by union (:func:`merge_expert_sets`).
"""

from __future__ import annotations

import csv
import io as _io
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import UserError
from .selection import ExpertSets, KeptMap, _fmt_ints, _is_int, removed_from_kept

EXPERT_LIST_FORMAT = "mlx-fun-expert-list"
EXPERT_LIST_VERSION = 1
EXPERT_LIST_MODES = ("prune", "merge")
CSV_HEADER = ("layer", "expert", "action")


# ---------------------------------------------------------------------------------------------- expert lists
def _moe_indices(num_layers: int, moe_layer_indices) -> list[int]:
    idx = list(range(num_layers)) if moe_layer_indices is None else [int(i) for i in moe_layer_indices]
    if len(idx) != num_layers:
        raise ValueError(f"moe_layer_indices has {len(idx)} entries but num_layers is {num_layers}")
    return idx


def _read_text(path: Path, what: str, fix: str) -> str:
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist; {fix}")
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path} cannot be read ({type(e).__name__}: {e}).") from None


def _no_dup_keys(path: Path):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise UserError(f"{path}: key '{k}' appears twice in one object; keep one of them.")
            seen.add(k)
        return dict(pairs)

    return hook


def _load_json(path: Path, what: str, fix: str, *, allow_nan: bool = False):
    from ..core import json_input

    return json_input.read(path, what, fix=fix, encoding="utf-8-sig", object_pairs_hook=_no_dup_keys(path),
                           allow_nan=allow_nan)


def _parse_layer_key(key, path: Path, moe_idx: list[int], where: str = "") -> int:
    """Decoder-layer index (str/int) → position; UserError naming the file when it is not an MoE layer."""
    k = str(key).strip()
    if not (k.isdigit() or (k.startswith("-") and k[1:].isdigit())):
        raise UserError(f"{path}{where}: layer '{key}' is not an integer decoder-layer index.")
    layer = int(k)
    if layer not in moe_idx:
        raise UserError(
            f"{path}{where}: layer {layer} is not an MoE layer of this model (MoE layers: {_fmt_ints(moe_idx)}); "
            "was the file made for another model?"
        )
    return moe_idx.index(layer)


def load_expert_list(
    path: str | os.PathLike,
    num_layers: int,
    num_experts: int,
    moe_layer_indices: list[int] | None = None,
) -> KeptMap:
    """Read an expert list (JSON or CSV, see the module docstring); return ``{position: sorted kept}``.

    The format follows the suffix (``.csv`` → CSV, ``.json`` → JSON; otherwise a file starting with ``{`` is
    JSON). Every MoE layer appears in the result; layers absent from the file keep all experts.
    """
    path = Path(path)
    moe_idx = _moe_indices(num_layers, moe_layer_indices)
    fix = "export it from the UI (filtered_experts.json/.csv) or write one (see `mlx-fun prune --help`)."
    text = _read_text(path, "expert list", fix)
    suffix = path.suffix.lower()
    is_csv = suffix == ".csv" or (suffix != ".json" and not text.lstrip().startswith("{"))
    if is_csv:
        spec = _parse_expert_csv(text, path, moe_idx, num_experts)
    else:
        spec = _parse_expert_json(path, moe_idx, num_experts)
    kept: KeptMap = {}
    for pos in range(num_layers):
        if pos not in spec:
            kept[pos] = list(range(num_experts))
            continue
        action, experts = spec[pos]
        kept[pos] = sorted(experts) if action == "keep" else sorted(set(range(num_experts)) - set(experts))
    return kept


def _parse_expert_json(path: Path, moe_idx: list[int], num_experts: int) -> dict[int, tuple[str, list[int]]]:
    data = _load_json(path, "expert list", "")
    if not isinstance(data, dict):
        raise UserError(f"{path}: an expert list must be a JSON object with \"format\" and \"layers\".")
    fmt = data.get("format")
    if fmt != EXPERT_LIST_FORMAT:
        raise UserError(
            f"{path}: \"format\" is {fmt!r}, expected \"{EXPERT_LIST_FORMAT}\"; is this an expert list exported by the UI?"
        )
    version = data.get("version", EXPERT_LIST_VERSION)
    if version != EXPERT_LIST_VERSION:
        raise UserError(f"{path}: expert-list version {version!r} is not supported; this mlx-fun reads version 1.")
    mode = data.get("mode", "prune")
    if mode not in EXPERT_LIST_MODES:
        raise UserError(f"{path}: \"mode\" is {mode!r}; use one of {', '.join(EXPERT_LIST_MODES)}.")
    if "num_experts" in data and data["num_experts"] != num_experts:
        raise UserError(
            f"{path} was made for a model with {data['num_experts']} experts per layer, but this model has "
            f"{num_experts}; export the list for this model."
        )
    layers = data.get("layers")
    if not isinstance(layers, dict):
        raise UserError(f"{path}: \"layers\" is missing or not an object mapping decoder-layer indices to {{\"remove\": [...]}}.")
    spec: dict[int, tuple[str, list[int]]] = {}
    for key, entry in layers.items():
        pos = _parse_layer_key(key, path, moe_idx)
        if pos in spec:
            raise UserError(f"{path}: layer {moe_idx[pos]} appears twice in \"layers\"; merge the two entries.")
        if not isinstance(entry, dict):
            raise UserError(f"{path}: layer {key} must be an object like {{\"remove\": [3, 17]}} or {{\"keep\": [...]}}.")
        actions = [a for a in ("remove", "keep") if a in entry]
        unknown = [k for k in entry if k not in ("remove", "keep")]
        if unknown:
            raise UserError(f"{path}: layer {key} has unknown key '{unknown[0]}'; use exactly one of \"remove\" or \"keep\".")
        if len(actions) != 1:
            raise UserError(
                f"{path}: layer {key} has {'both' if actions else 'neither of'} \"remove\" and \"keep\"; "
                "give exactly one of them per layer."
            )
        action = actions[0]
        experts = entry[action]
        if not isinstance(experts, list):
            raise UserError(f"{path}: layer {key} \"{action}\" must be a list of expert indices.")
        seen: set[int] = set()
        for e in experts:
            if not _is_int(e):
                raise UserError(f"{path}: layer {key} \"{action}\" has {e!r}, which is not an integer expert index.")
            if not 0 <= e < num_experts:
                raise UserError(
                    f"{path}: layer {key} \"{action}\" has expert {e}, out of range 0..{num_experts - 1} "
                    f"(the model has {num_experts} experts)."
                )
            if e in seen:
                raise UserError(f"{path}: layer {key} \"{action}\" lists expert {e} twice; list each expert once.")
            seen.add(int(e))
        spec[pos] = (action, sorted(seen))
    return spec


def _parse_expert_csv(text: str, path: Path, moe_idx: list[int], num_experts: int) -> dict[int, tuple[str, list[int]]]:
    reader = csv.reader(_io.StringIO(text))
    header_seen = False
    actions: dict[int, tuple[str, int]] = {}  # pos -> (action, first line)
    rows: dict[tuple[int, int], int] = {}  # (pos, expert) -> line
    experts: dict[int, list[int]] = {}
    for row in reader:
        line = reader.line_num
        cells = [c.strip() for c in row]
        if not cells or all(not c for c in cells) or cells[0].startswith("#"):
            continue
        if not header_seen:
            if tuple(c.lower() for c in cells) != CSV_HEADER:
                raise UserError(
                    f"{path}, line {line}: expected the header 'layer,expert,action', found '{','.join(row)}'."
                )
            header_seen = True
            continue
        if len(cells) != 3:
            raise UserError(f"{path}, line {line}: expected 3 fields (layer,expert,action), found {len(cells)}.")
        layer_s, expert_s, action = cells[0], cells[1], cells[2].lower()
        pos = _parse_layer_key(layer_s, path, moe_idx, where=f", line {line}")
        if not expert_s.isdigit():
            raise UserError(f"{path}, line {line}: expert '{expert_s}' is not a non-negative integer.")
        e = int(expert_s)
        if e >= num_experts:
            raise UserError(
                f"{path}, line {line}: expert {e} is out of range 0..{num_experts - 1} (the model has {num_experts} experts)."
            )
        if action not in ("remove", "keep"):
            raise UserError(f"{path}, line {line}: action '{cells[2]}' must be 'remove' or 'keep'.")
        if pos in actions and actions[pos][0] != action:
            prev, prev_line = actions[pos]
            raise UserError(
                f"{path}, line {line}: layer {moe_idx[pos]} mixes '{action}' with '{prev}' (line {prev_line}); "
                "use one action per layer."
            )
        actions.setdefault(pos, (action, line))
        if (pos, e) in rows:
            raise UserError(
                f"{path}, line {line}: expert {e} of layer {moe_idx[pos]} is listed twice (also on line {rows[(pos, e)]})."
            )
        rows[(pos, e)] = line
        experts.setdefault(pos, []).append(e)
    if not header_seen:
        raise UserError(f"{path}: the CSV is empty; it needs the header 'layer,expert,action' and one row per expert.")
    return {pos: (actions[pos][0], sorted(ex)) for pos, ex in experts.items()}


def save_expert_list(
    path: str | os.PathLike,
    kept: Mapping[int, Iterable[int]],
    *,
    num_experts: int,
    moe_layer_indices: list[int] | None = None,
    model_type: str | None = None,
    mode: str = "prune",
    force: bool = False,
    flag: str | None = None,
    force_flag: str | None = None,
) -> Path:
    """Write a kept map as an expert list (``remove`` lists), atomically. ``.csv`` suffix → CSV, else JSON. An
    existing file only with ``force`` (:func:`mlx_fun.core.writer.check_output_path`: ``flag``, ``force_flag``)."""
    from ..core.writer import write_json, write_text

    path = Path(path)
    names = lambda p: int(moe_layer_indices[p]) if moe_layer_indices is not None else int(p)  # noqa: E731
    removed = removed_from_kept(kept, num_experts)
    if path.suffix.lower() == ".csv":
        buf = _io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(CSV_HEADER)
        for pos in sorted(removed):
            for e in removed[pos]:
                w.writerow([names(pos), e, "remove"])
        write_text(path, buf.getvalue(), force=force, flag=flag, force_flag=force_flag)
        return path
    obj: dict = {"format": EXPERT_LIST_FORMAT, "version": EXPERT_LIST_VERSION, "mode": mode}
    if model_type is not None:
        obj["model_type"] = model_type
    obj["num_experts"] = int(num_experts)
    obj["layers"] = {str(names(pos)): {"remove": removed[pos]} for pos in sorted(removed)}
    write_json(path, obj, force=force, flag=flag, force_flag=force_flag)
    return path


# ---------------------------------------------------------------------------------------------- reports
def _read_layer_map(obj, key: str, path: Path, moe_idx: list[int], num_experts: int | None) -> ExpertSets:
    if not isinstance(obj, dict):
        raise UserError(f"{path}: \"{key}\" must be an object mapping decoder-layer indices to expert lists.")
    out: ExpertSets = {}
    for layer, experts in obj.items():
        pos = _parse_layer_key(layer, path, moe_idx, where=f" (\"{key}\")")
        if not isinstance(experts, list):
            raise UserError(f"{path}: \"{key}\" layer {layer} must be a list of expert indices.")
        for e in experts:
            if not _is_int(e) or e < 0 or (num_experts is not None and e >= num_experts):
                rng = f"0..{num_experts - 1}" if num_experts is not None else "non-negative integers"
                raise UserError(f"{path}: \"{key}\" layer {layer} has expert {e!r}, expected {rng}.")
        out.setdefault(pos, set()).update(int(e) for e in experts)
    return out


def load_report_experts(
    path: str | os.PathLike,
    kind: str = "safety",
    moe_layer_indices: list[int] | None = None,
    num_experts: int | None = None,
) -> ExpertSets:
    """Expert sets of a ``safety_report.json`` / ``domain_report.json``: ``{layer position: {experts}}``.

    safety: ``safety_critical``, else the union of ``hcdg`` and ``hrcg``; hcdg: ``hcdg`` (what steering's safety
    modes act on); domain: ``domain_experts``; general: the
    ``general_experts`` of a domain report. Layer keys are decoder-layer indices, converted to positions with
    ``moe_layer_indices`` (``None``: keys are positions).
    """
    path = Path(path)
    if kind not in ("safety", "hcdg", "domain", "general"):
        raise ValueError(f"kind must be 'safety', 'hcdg', 'domain' or 'general', got {kind!r}")
    report = "safety" if kind in ("safety", "hcdg") else "domain"
    scan = f"{report}-scan"
    # a report's scores may hold NaN as Python's json writes it: the commands that read scores refuse them
    data = _load_json(path, f"{report} report", f"create it with `mlx-fun {scan}`.", allow_nan=True)
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a {report} report (expected a JSON object); create it with `mlx-fun {scan}`.")
    if moe_layer_indices is None:
        keys = []
        for k in ("safety_critical", "hcdg", "hrcg", "domain_experts", "general_experts"):
            if isinstance(data.get(k), dict):
                keys += [int(x) for x in data[k] if str(x).strip().lstrip("-").isdigit()]
        moe_idx = list(range(max(keys, default=-1) + 1))
    else:
        moe_idx = [int(i) for i in moe_layer_indices]
    if kind == "hcdg":  # steering's safety modes act on the experts more active on harmful prompts
        if "hcdg" not in data:
            raise UserError(f"{path} has no \"hcdg\" map, the experts steering acts on; write the report with "
                            "`mlx-fun safety-scan`.")
        return _read_layer_map(data["hcdg"], "hcdg", path, moe_idx, num_experts)
    if kind == "safety":
        if "safety_critical" in data:
            return _read_layer_map(data["safety_critical"], "safety_critical", path, moe_idx, num_experts)
        if "hcdg" in data or "hrcg" in data:
            parts = [
                _read_layer_map(data[k], k, path, moe_idx, num_experts) for k in ("hcdg", "hrcg") if k in data
            ]
            return merge_expert_sets(*parts)
        raise UserError(
            f"{path} has no \"safety_critical\" (nor \"hcdg\"/\"hrcg\") map; pass a safety_report.json written by "
            "`mlx-fun safety-scan`."
        )
    key = "general_experts" if kind == "general" else "domain_experts"
    if key not in data:
        raise UserError(f"{path} has no \"{key}\" map; pass a domain_report.json written by `mlx-fun domain-scan`.")
    return _read_layer_map(data[key], key, path, moe_idx, num_experts)


def merge_expert_sets(*maps: Mapping[int, Iterable[int]] | None) -> ExpertSets:
    """Union of per-layer expert sets (``None`` entries are skipped); layers missing from a map add nothing."""
    out: ExpertSets = {}
    for m in maps:
        if m is None:
            continue
        for pos, experts in m.items():
            out.setdefault(int(pos), set()).update(int(e) for e in experts)
    return out
