"""Runtime-sorted MoE expert dispatch: pick the grouped-matmul strategy from the token count, per backend.

mlx-lm's ``SwitchGLU`` sorts the (token, expert) pairs by expert whenever ``indices.size >= 64`` — one fixed
guess for every backend, dtype and expert shape. :class:`DispatchedSwitchGLU` is a drop-in for its ``__call__``
that decides at every call, from the token count ``M`` (the product of ``indices.shape[:-1]``) and a measured
cut-off table keyed by ``(backend, quantization, D, H, E, k)``, among these plans:

- ``mlx-lm``: whatever mlx-lm's rule picks (the band of a table where nothing was measurably faster);
- ``unsorted``: mlx-lm's small-batch path (``gather_mm``/``gather_qmm`` straight on the routed indices);
- ``sorted``: mlx-lm's large-batch path (``_gather_sort`` → ``sorted_indices=True`` → ``_scatter_unsort``);
- ``blocked<R>``: sorted, then every expert's rows padded to a multiple of ``R`` so that each block of ``R``
  rows belongs to one expert; the grouped matmul then multiplies ``R`` rows per weight fetch (a real GEMM per
  block instead of one GEMV per row, which is what MLX's CPU ``gather_mm`` otherwise does). Shapes stay static
  (no host sync): at most ``ceil((N + min(E, N)(R-1)) / R)`` blocks for ``N = M·k`` rows;
- ``dequant:<layout>`` (quantized experts only): dequantize the experts, then run the layout with ``gather_mm``.
  Without a cache the experts are dequantized at every call (worth it only for large ``M``); with
  ``dequant_cache_bytes`` the dequantized experts are kept per layer, up to that budget (reported in bytes).

Half-precision experts on the CPU run in float32 (:func:`half_on_cpu`): float ones stored in float16 / bfloat16
(most published float MoE checkpoints), because MLX's CPU ``gather_mm`` refuses other dtypes ("[GatherMM::eval]
Currently only supports float32", so mlx-lm itself cannot run such a model there); and quantized ones with float16 /
bfloat16 scales (what ``mlx_lm.convert`` writes for such a checkpoint), because MLX's CPU ``gather_qmm`` is about
10× (bfloat16) and 45× (float16) slower than in float32 at 64 rows (:mod:`mlx_fun.dispatch.dense` says the same of
dense layers). Calls with fewer routed rows than experts (decode) cast only the chosen experts' weights (scales and
biases when quantized); larger ones cast the layer's once per call; the output keeps the input's dtype and the
stored weights are untouched. This is installed in both modes (``mlx-lm`` keeps mlx-lm's plan choice).

The ``unsorted``/``sorted`` plans call the very same projections in the same order as mlx-lm, so their outputs
are bit-identical to mlx-lm's; ``blocked`` and ``dequant`` compute the same products with a different
accumulation order (float tolerance; greedy tokens are unchanged in the tests).

Installation is a class swap (``obj.__class__ = DispatchedSwitchGLU``, a subclass), so parameters, weight keys
and saved files are unchanged, and it coexists with :mod:`mlx_fun.model.moe_hook` (which swaps the MoE *block*). The
per-instance state lives in the instance ``__dict__``, outside the module's parameter tree.

Table lookup: an exact key; else the nearest entry of the same backend and the same weight class (float or
quantized), by quantization mismatch and log-distance of the shapes; else mlx-lm's own rule (sort when
``M·k >= 64``). Tables: the shipped ``mlx_fun/dispatch/dispatch_table.json``, the user table written by
``mlx-fun tune-dispatch`` (``$MLX_FUN_DISPATCH_TABLE``, default ``~/.cache/mlx-fun/dispatch_table.json``) and an
explicit ``table_path`` — later ones take precedence for the same key.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from ..core import classswap
from . import dense as dispatch_dense
from .. import mlx_lm_compat
from .table import (  # noqa: F401 - re-exported: the table is part of this module's API
    Entry,
    LayerKey,
    MLX_LM,
    MLX_LM_SORT_SIZE,
    Plan,
    SHIPPED_TABLE,
    SORTED,
    TABLE_ENV,
    TABLE_VERSION,
    Table,
    UNSORTED,
    backend_name,
    bands_to_json,
    default_entry,
    dtype_name,
    is_quant_key,
    load_table,
    merge_table_files,
    mlx_lm_bands,
    mlx_lm_plan,
    plan_for,
    quant_key,
    quant_name,
    read_table,
    shipped_table,
    table_text,
    user_table_path,
    write_table,
)
from ..core.sizes import format_bytes, parse_bytes  # noqa: F401 - re-exported: part of this module's API

# mlx-lm's sorted path, private to it: a newer mlx-lm without them is one line at import (mlx_lm_compat)
_gather_sort = mlx_lm_compat.get("dispatch", "mlx_lm.models.switch_layers", "_gather_sort")
_scatter_unsort = mlx_lm_compat.get("dispatch", "mlx_lm.models.switch_layers", "_scatter_unsort")

MODES = ("auto", "mlx-lm")
#: most (token, expert) rows one grouped-matmul call may have, per backend. MLX's CUDA kernels put the batch of
#: a batched matrix-vector product (gather_qmm / gather_mm on the routed rows) on gridDim.y/z, which CUDA caps at
#: 65,535: 65,536 rows fail with ``cuGraphAddKernelNode(...) failed: invalid argument`` (e.g. 4 × 2,048 tokens ×
#: top-8; the same class as ml-explore/mlx#3858 and #3893). The dispatch splits larger calls into calls under it.
MAX_ROWS = {"cuda": 65535}
_STATE = "_mlxfun_dispatch"
_PROJS = ("up_proj", "gate_proj", "down_proj")


# ------------------------------------------------------------------------------------------ the dispatcher


def _dequantize(proj, dtype=None):
    """The (E, out, in) float weights of a ``QuantizedSwitchLinear`` (None for a float projection)."""
    if not isinstance(proj, QuantizedSwitchLinear):
        return None
    return dispatch_dense.dequantize_weight(proj, dtype)


def _project(proj, w, x, idx, sorted_indices: bool, bias_idx=None):
    """``proj(x, idx)``, or the same product on the dequantized weights ``w`` (incl. the projection's bias, whose
    rows ``bias_idx`` names where ``w`` holds selected experts rather than all of them). ``w`` may also be a
    quantized ``(weight, scales, biases)`` triple (:func:`mlx_fun.dispatch.dense.upcast_scales`)."""
    if w is None:
        return proj(x, idx, sorted_indices=sorted_indices)
    if isinstance(w, tuple):
        y = mx.gather_qmm(x, *w, rhs_indices=idx, transpose=True, group_size=proj.group_size, bits=proj.bits,
                          mode=proj.mode, sorted_indices=sorted_indices)
    else:
        if w.dtype != x.dtype:
            w = w.astype(x.dtype)
        y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sorted_indices)
    if "bias" in proj:
        y = y + mx.expand_dims(proj["bias"][idx if bias_idx is None else bias_idx].astype(y.dtype), -2)
    return y


def half_on_cpu(module, backend: str) -> bool:
    """Experts in half precision on the CPU: float ones stored in float16 / bfloat16 (the CPU ``gather_mm`` runs
    float32 only) or quantized ones with float16 / bfloat16 scales (its ``gather_qmm`` is far slower in them)."""
    proj = module.up_proj
    if backend != "cpu":
        return False
    if isinstance(proj, QuantizedSwitchLinear):
        return all(dispatch_dense.half_scales(getattr(module, n)) for n in _PROJS)
    w = getattr(proj, "weight", None)
    return w is not None and w.dtype in dispatch_dense.HALF


def _float32_weights(module, select=None) -> list:
    """The three projections' weights for a float32 call: float ones cast, quantized ones with float32 scales and
    biases (rows ``select`` only, where given)."""
    out = []
    for n in _PROJS:
        proj = getattr(module, n)
        if isinstance(proj, QuantizedSwitchLinear):
            out.append(dispatch_dense.upcast_scales(proj, select))
        else:
            w = proj["weight"]
            out.append((w if select is None else w[select]).astype(mx.float32))
    return out


def run_upcast(module, x, indices, plan: Plan, cache: list | None = None) -> mx.array:
    """``run_plan`` in float32 for half-precision experts (:func:`half_on_cpu`); output in ``x``'s dtype. A
    ``dequant`` plan (quantized experts) multiplies float32 dequantized weights (``cache`` where kept)."""
    x32 = x.astype(mx.float32)
    if indices.size < int(module.up_proj.num_experts) and x.size == (indices.size // indices.shape[-1]) * x.shape[-1]:
        # fewer routed rows than experts: cast only the chosen experts, one matrix per row
        flat = mx.stop_gradient(indices).reshape(-1)
        rows = mx.arange(flat.size, dtype=mx.uint32).reshape(indices.shape)
        weights = _float32_weights(module, flat)
        y = _experts(module, mx.expand_dims(x32, (-2, -3)), rows, False, weights, bias_idx=indices)
        return y.squeeze(-2).astype(x.dtype)
    if plan.dequant:
        weights = cache if cache is not None else [_dequantize(getattr(module, n), mx.float32) for n in _PROJS]
    else:
        weights = _float32_weights(module)
    return run_plan(module, x32, indices, plan, weights=weights).astype(x.dtype)


def blocked_layout(flat_sorted: mx.array, num_experts: int, block: int):
    """For expert ids sorted ascending (N,), the padded layout with blocks of ``block`` rows of one expert.

    Returns ``(P, pos, block_expert)``: ``P`` blocks (static: ``ceil((N + min(E, N)(block-1)) / block)``),
    ``pos`` (N,) the padded row of each sorted row, ``block_expert`` (P,) uint32 the (non-decreasing) expert of
    each block; blocks past the used ones are zero padding.
    """
    n = flat_sorted.shape[0]
    E, R = num_experts, block
    P = -(-(n + min(E, n) * (R - 1)) // R)
    ids = flat_sorted.astype(mx.int32)
    counts = mx.zeros((E,), mx.int32).at[ids].add(mx.ones((n,), mx.int32))
    nblocks = (counts + (R - 1)) // R
    bstart = mx.cumsum(nblocks) - nblocks  # first block of each expert
    cstart = mx.cumsum(counts) - counts  # first sorted row of each expert
    pos = mx.arange(n, dtype=mx.int32) - cstart[ids] + bstart[ids] * R
    marker = mx.zeros((P + 1,), mx.int32).at[bstart].maximum(mx.arange(E, dtype=mx.int32))
    block_expert = mx.cummax(marker[:P]).astype(mx.uint32)
    return P, pos, block_expert


@dataclass
class DispatchState:
    """Per-instance state (kept in the instance ``__dict__``, not in the parameter tree)."""

    table: Table
    backend: str
    key: LayerKey
    quantized: bool
    cache: list | None = None  # dequantized (E, out, in) weights per projection, when allowed
    entries: dict = field(default_factory=dict)  # k -> (Entry, how)
    plans: dict = field(default_factory=dict)  # (m, k) -> Plan (resolved: never MLX_LM)
    calls: dict = field(default_factory=dict)  # (m, k) -> Plan, or None: mlx-lm's own call does the same
    force: Plan | None = None  # tests / benchmarks: always this plan
    upcast: bool = False  # half-precision float experts on the CPU: run in float32 (half_on_cpu)
    max_rows: int | None = None  # split calls with more (token, expert) rows than this (MAX_ROWS)

    def entry(self, k: int) -> tuple[Entry, str]:
        got = self.entries.get(k)
        if got is None:
            got = self.entries[k] = self.table.lookup(self.backend, self.key, k)
        return got

    def resolve(self, m: int, k: int) -> Plan:
        if self.force is not None:
            plan = self.force
        else:
            plan = self.entry(k)[0].plan(m, cached=self.cache is not None)
        if plan.layout == "mlx-lm":
            plan = mlx_lm_plan(m, k)
        elif plan.dequant and not self.quantized:
            plan = plan.native
        self.plans[(m, k)] = plan
        self.calls[(m, k)] = None if plan == mlx_lm_plan(m, k) else plan
        return plan


class DispatchedSwitchGLU(SwitchGLU):
    """mlx-lm's ``SwitchGLU`` whose call picks unsorted / sorted / blocked / dequantized per token count."""

    def __call__(self, x, indices) -> mx.array:
        state: DispatchState | None = self.__dict__.get(_STATE)
        k = indices.shape[-1]
        m = indices.size // k if k else 0
        if state is None or m == 0:
            return SwitchGLU.__call__(self, x, indices)
        if state.max_rows and m * k > state.max_rows and x.size == m * x.shape[-1]:
            return _split_rows(self, x, indices, max(1, state.max_rows // k))
        key = (m, k)
        if key not in state.calls:
            state.resolve(m, k)
        plan = state.calls[key]
        if state.upcast:
            return run_upcast(self, x, indices, plan or state.plans[key], state.cache)
        if plan is None or (plan.dequant and state.backend == "cpu" and x.dtype != mx.float32):
            # mlx-lm's own choice (also where MLX's float32-only CPU gather_mm rules out a dequant plan)
            return SwitchGLU.__call__(self, x, indices)
        return run_plan(self, x, indices, plan, state.cache)


def _split_rows(module, x, indices, step: int) -> mx.array:
    """The call on ``step`` tokens at a time, concatenated: no call exceeds the backend's row limit."""
    *lead, k = indices.shape
    d = x.shape[-1]
    xs, ids = x.reshape(-1, d), indices.reshape(-1, k)
    outs = [DispatchedSwitchGLU.__call__(module, xs[i:i + step], ids[i:i + step]) for i in range(0, ids.shape[0], step)]
    return mx.concatenate(outs, axis=0).reshape(*lead, k, -1)


def _experts(module, x, idx, sorted_indices: bool, weights, bias_idx=None):
    """up, gate, down in mlx-lm's order; ``weights`` None (stored weights) or a dequantized triple."""
    w_up, w_gate, w_down = weights if weights is not None else (None, None, None)
    x_up = _project(module.up_proj, w_up, x, idx, sorted_indices, bias_idx)
    x_gate = _project(module.gate_proj, w_gate, x, idx, sorted_indices, bias_idx)
    return _project(module.down_proj, w_down, module.activation(x_up, x_gate), idx, sorted_indices, bias_idx)


def run_plan(module, x, indices, plan: Plan, cache: list | None = None, weights: list | None = None) -> mx.array:
    """Run a SwitchGLU-like ``module`` on ``x`` (..., D) routed to ``indices`` (..., k) with ``plan``.

    Returns (..., k, D) unweighted expert outputs, as mlx-lm's ``SwitchGLU.__call__`` does. ``weights``: the
    (E, out, in) triple to multiply by instead of the stored ones (float32 copies of half-precision experts).
    """
    if plan.layout == "mlx-lm":
        plan = mlx_lm_plan(indices.size // max(1, indices.shape[-1]), indices.shape[-1])
    if plan.dequant and weights is None:
        weights = cache if cache is not None else [_dequantize(getattr(module, n), x.dtype) for n in _PROJS]
    indices = mx.stop_gradient(indices)
    if plan.layout == "blocked":
        return _run_blocked(module, x, indices, plan.block, weights)
    x = mx.expand_dims(x, (-2, -3))
    do_sort = plan.layout == "sorted"
    idx, inv_order = indices, None
    if do_sort:
        x, idx, inv_order = _gather_sort(x, indices)
    x = _experts(module, x, idx, do_sort, weights)
    if do_sort:
        x = _scatter_unsort(x, inv_order, indices.shape)
    return x.squeeze(-2)


def _run_blocked(module, x, indices, block: int, weights) -> mx.array:
    *lead, k = indices.shape
    d = x.shape[-1]
    n = indices.size
    m = n // k
    if x.size != m * d:  # x not one row per routed token (never seen in mlx-lm): take the plain sorted path
        return run_plan(module, x, indices, Plan("sorted", 0, weights is not None), weights)
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    num_experts = int(module.up_proj.num_experts)
    P, pos, block_expert = blocked_layout(flat[order], num_experts, block)
    # padded row -> source token (m = the appended zero row for padding)
    src = mx.full((P * block,), m, dtype=mx.int32)
    src[pos] = (order // k).astype(mx.int32)
    rows = mx.concatenate([x.reshape(m, d), mx.zeros((1, d), dtype=x.dtype)], axis=0)
    xp = rows[src].reshape(P, block, d)
    y = _experts(module, xp, block_expert, True, weights)
    y = y.reshape(P * block, -1)[pos[inv_order]]
    return y.reshape(*lead, k, y.shape[-1])


# ------------------------------------------------------------------------------------- install / remove

_TAG = "dispatch"
classswap.register(SwitchGLU, _TAG, DispatchedSwitchGLU.__call__, DispatchedSwitchGLU)


def _dispatchable(cls: type) -> bool:
    """SwitchGLU, or a subclass of it that keeps SwitchGLU's ``__call__`` (dispatched ones included)."""
    return isinstance(cls, type) and issubclass(cls, SwitchGLU) and (
        cls.__call__ is SwitchGLU.__call__ or cls.__call__ is DispatchedSwitchGLU.__call__)


def is_dispatched(module) -> bool:
    return classswap.is_swapped(module, _TAG)


def expert_modules(model) -> list:
    """Every SwitchGLU-like module of ``model`` (dispatched or not), in tree order."""
    found = []
    for _, mod in model.named_modules():
        if _dispatchable(type(mod)):
            found.append(mod)
    return found


def _cache_bytes(module, dtype=None) -> int:
    total = 0
    for name in _PROJS:
        p = getattr(module, name)
        if isinstance(p, QuantizedSwitchLinear):
            n = int(p.num_experts) * int(p.output_dims) * int(p.input_dims)
            total += n * (dtype or p.scales.dtype).size
    return total


@dataclass
class DispatchReport:
    """What :func:`install` did."""

    mode: str
    backend: str
    layers: int = 0
    entries: dict = field(default_factory=dict)  # LayerKey -> (Entry, how) (k-agnostic lookup)
    cache_budget: int = 0
    cache_bytes: int = 0
    cached_layers: int = 0
    dense_layers: int = 0  # dense quantized linears swapped (mlx_fun.dispatch.dense)
    quantized_layers: int = 0
    upcast_layers: int = 0  # half-precision expert layers run in float32 (half_on_cpu)
    half_dense: int = 0  # dense quantized linears / tied heads with half-precision scales run in float32
    cache_note: str = ""
    table_sources: list = field(default_factory=list)

    def brief(self) -> str:
        """What every model command prints, in words: who runs the experts and where the cut-offs come from, plus
        what changes the numbers or the memory (half-precision layers run in float32, the dequant cache asked for).
        The full line (:meth:`summary`: each expert shape's table entry) is ``mlx-fun doctor --model``'s."""
        notes = ""
        if self.upcast_layers:
            notes += (f"; {self.upcast_layers} half-precision expert layer(s) run in float32 (MLX's CPU runs them "
                      "faster so)")
        if self.half_dense:
            notes += f"; {self.half_dense} dense quantized layer(s) with half-precision scales run in float32"
        if self.cache_budget:
            notes += (f"; dequant cache {format_bytes(self.cache_bytes)} for {self.cached_layers}/"
                      f"{self.quantized_layers} quantized layer(s) (budget {format_bytes(self.cache_budget)})"
                      + (f": {self.cache_note}" if self.cache_note else ""))
        if self.mode != "auto":
            return "experts: mlx-lm's own dispatch (--dispatch mlx-lm)" + notes
        hows = [how for _entry, how in self.entries.values()]
        tuned = [entry for entry, how in self.entries.values() if how != "default"]
        if not self.entries:
            return f"experts: none to dispatch on {self.backend}" + notes
        if not tuned:
            return (f"experts: mlx-lm's rule on {self.backend} (no dispatch table tuned for this machine's "
                    f"{self.backend} yet)" + notes)
        names = sorted({"shipped table" if e.source == "shipped" else f"table {Path(e.source).name}" for e in tuned})
        if "default" in hows:
            how = f"tuned for {len(tuned)} of {len(hows)} expert shapes, mlx-lm's rule for the rest"
        elif "nearest" in hows:
            how = "tuned for a similar expert shape"
        else:
            how = "tuned for this model's expert shape" + ("s" if len(hows) > 1 else "")
        return f"experts: runtime dispatch on {self.backend}, {how} ({', '.join(names)})" + notes

    def summary(self) -> str:
        upcast = (f"; {self.upcast_layers} half-precision expert layer(s) run in float32 (MLX's CPU gather_mm is "
                  "float32-only, its gather_qmm far slower in half precision)") if self.upcast_layers else ""
        if self.half_dense:
            upcast += f"; {self.half_dense} dense quantized layer(s) with half-precision scales run in float32"
        if self.mode != "auto":
            return "dispatch: mlx-lm (its fixed rule: sort when indices.size >= 64)" + upcast
        parts = [f"dispatch: auto on {self.backend}, {self.layers} expert layer(s)"]
        for key, (entry, how) in self.entries.items():
            if how == "default":
                parts.append(f"{key.quant} D{key.D} H{key.H} E{key.E}: no {self.backend} entry, mlx-lm rule")
            else:
                parts.append(f"{key.quant} D{key.D} H{key.H} E{key.E}: {how} entry "
                             f"{entry.quant} D{entry.D} H{entry.H} E{entry.E} k{entry.k} ({entry.source})")
        if self.dense_layers:
            parts.append(f"{self.dense_layers} dense quantized linear(s) dequantized from "
                         f"{dispatch_dense.MIN_ROWS[self.backend]} tokens on")
        if self.cache_budget:
            parts.append(f"dequant cache {format_bytes(self.cache_bytes)} for {self.cached_layers}/"
                         f"{self.quantized_layers} quantized layer(s) (budget {format_bytes(self.cache_budget)})"
                         + (f"; {self.cache_note}" if self.cache_note else ""))
        return "; ".join(parts) + upcast


def install(
    model,
    table: Table | None = None,
    dequant_cache_bytes: int = 0,
    backend: str | None = None,
    force: Plan | str | None = None,
    dense_dequantize: bool = True,
) -> DispatchReport:
    """Swap every SwitchGLU of ``model`` for :class:`DispatchedSwitchGLU` (re-installing replaces the state).

    ``dequant_cache_bytes`` > 0 allows keeping dequantized experts of quantized layers, in layer order, while
    they fit the budget, and only for layers whose table entry ever picks a ``dequant`` plan; they are
    dequantized (and evaluated) here. ``force`` pins one plan for every call (tests, benchmarks).
    ``dense_dequantize=False`` (``--dispatch mlx-lm``): of the dense quantized linears, only those with
    half-precision scales are swapped, to run in float32 (:func:`mlx_fun.dispatch.dense.install`).
    """
    table = table if table is not None else load_table()
    backend = backend or backend_name()
    forced = Plan.parse(force) if isinstance(force, str) else force
    report = DispatchReport("auto", backend, cache_budget=int(dequant_cache_bytes), table_sources=table.sources)
    budget = int(dequant_cache_bytes)
    report.dense_layers, report.half_dense = dispatch_dense.install(model, backend, dequantize=dense_dequantize)
    for module in expert_modules(model):
        key = LayerKey.of(module)
        quantized = any(isinstance(getattr(module, n), QuantizedSwitchLinear) for n in _PROJS)
        old = module.__dict__.get(_STATE)
        state = DispatchState(table, backend, key, quantized, force=forced, max_rows=MAX_ROWS.get(backend),
                              upcast=half_on_cpu(module, backend))
        report.upcast_layers += state.upcast
        if key not in report.entries:
            report.entries[key] = table.lookup(backend, key, None)
        report.layers += 1
        if quantized:
            report.quantized_layers += 1
        entry = report.entries[key][0]
        if quantized and budget > 0 and (forced is not None or entry.uses_dequant(cached=True)):
            dtype = mx.float32 if backend == "cpu" else None
            need = _cache_bytes(module, dtype)
            if old is not None and old.cache is not None:
                state.cache = old.cache
                budget -= need
                report.cache_bytes += need
                report.cached_layers += 1
            elif need <= budget:
                state.cache = [_dequantize(getattr(module, n), dtype) for n in _PROJS]
                mx.eval([w for w in state.cache if w is not None])
                budget -= need
                report.cache_bytes += need
                report.cached_layers += 1
        classswap.set_state(module, _STATE, state)
        classswap.swap(module, _TAG, DispatchedSwitchGLU.__call__, name=f"Dispatched{type(module).__name__}")
    if dequant_cache_bytes and report.quantized_layers == 0:
        report.cache_note = "no quantized expert layers"
    elif dequant_cache_bytes and report.cached_layers == 0 and report.quantized_layers:
        if all(not e.uses_dequant(cached=True) for e, _ in report.entries.values()):
            report.cache_note = f"unused: the table never picks a dequantized plan for these shapes on {backend}"
        else:
            report.cache_note = "the budget is smaller than one layer's dequantized experts"
    return report


def remove(model) -> int:
    """Restore the original class of every dispatched module and drop its state (and cache). Returns the count."""
    n = dispatch_dense.remove(model)
    for _, module in model.named_modules():
        n += classswap.restore(module, _TAG)
        classswap.drop_state(module, _STATE)
    return n


def apply(
    model,
    mode: str = "auto",
    table_path: str | os.PathLike | None = None,
    dequant_cache_bytes: int = 0,
) -> DispatchReport:
    """One call for commands: ``auto`` installs the dispatch (shipped + user + ``table_path`` tables),
    ``mlx-lm`` leaves (or restores) mlx-lm's own SwitchGLU. Raises ``ValueError`` for a bad mode or table."""
    if mode not in MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "mlx-lm":
        remove(model)
        backend = backend_name()
        if any(half_on_cpu(m, backend) for m in expert_modules(model)):
            report = install(model, Table(), force=MLX_LM, dense_dequantize=False)  # mlx-lm's own plans, in float32
        else:
            report = DispatchReport("mlx-lm", backend)
            _, report.half_dense = dispatch_dense.install(model, backend, dequantize=False)
        report.mode, report.dense_layers = "mlx-lm", 0
        return report
    return install(model, load_table(table_path), dequant_cache_bytes=dequant_cache_bytes)


def state_of(module) -> DispatchState | None:
    return module.__dict__.get(_STATE)


__all__ = [
    "MODES",
    "DispatchReport",
    "DispatchState",
    "DispatchedSwitchGLU",
    "Entry",
    "LayerKey",
    "Plan",
    "Table",
    "apply",
    "backend_name",
    "blocked_layout",
    "expert_modules",
    "half_on_cpu",
    "install",
    "run_upcast",
    "is_dispatched",
    "load_table",
    "merge_table_files",
    "mlx_lm_bands",
    "mlx_lm_plan",
    "parse_bytes",
    "plan_for",
    "quant_key",
    "read_table",
    "remove",
    "run_plan",
    "shipped_table",
    "table_text",
    "write_table",
    "user_table_path",
]
