"""Measure the dispatch cut-offs of one expert shape on the current backend (``mlx-fun tune-dispatch``).

For each token count M (1 … 4096) every candidate plan (mlx-lm's rule, unsorted, sorted, blocked<R>, and for
quantized experts dequant:<layout> with and without a cache) runs the same layer on the same random inputs;
timings are interleaved in rounds, each call forced with ``mx.eval``, and the median kept. A candidate that is
already ≥ ``prune``× slower than the best at two consecutive M and is not catching up is dropped for larger M
(mlx-lm's own plan, unsorted or sorted by its rule, is always measured).

Bands: at each measured M the fastest plan wins only when it beats mlx-lm's plan by ``margin`` (default 5%)
and by 20 µs, else the band follows mlx-lm (``plan: "mlx-lm"``), so that noise never moves us off mlx-lm's numerics. An
isolated winner between two equal neighbours that are within 10% of it is smoothed away. Between two measured
M the boundary is their geometric mean; the last band extends to any larger M.
"""

from __future__ import annotations

import math
import platform
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from . import experts as dsp
from .experts import MLX_LM, Entry, Plan, mlx_lm_plan
from .tune_options import Measurement  # noqa: F401 - the tune-dispatch job's option group ``measure``

DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BLOCKS = (8, 16, 32, 64)
QUANT_DEFAULT_GS = {"affine": 64, "mxfp4": 32, "nvfp4": 16, "mxfp8": 32}
QUANT_FIXED_BITS = {"mxfp4": 4, "nvfp4": 4, "mxfp8": 8}


def device_description() -> str:
    """Backend and device name, e.g. ``cuda: NVIDIA H100 80GB HBM3`` or ``cpu: AMD EPYC (x86_64, 2 cores)``."""
    import os

    backend = dsp.backend_name()
    try:
        info = mx.device_info()
    except Exception:
        info = {}
    name = info.get("device_name") or platform.processor() or platform.machine()
    if backend == "cpu":
        name = f"{name} ({platform.machine()}, {os.cpu_count()} cores)"
    return f"{backend}: {name}"


# ------------------------------------------------------------------------------------------------ layers


@dataclass(frozen=True)
class LayerSpec:
    """A synthetic expert layer: shapes, quantization key (``bfloat16``, ``affine4-g64``, …) and the dtype of
    activations (and of float weights / quantization scales)."""

    D: int
    H: int
    E: int
    k: int
    quant: str = "float32"
    dtype: str = "float32"
    bias: bool = False
    oai: bool = False  # gpt-oss SwiGLU (clamped, alpha 1.702) instead of SiLU-GLU

    def label(self) -> str:
        return f"{self.quant} D{self.D} H{self.H} E{self.E} k{self.k}"


def parse_quant(text: str) -> tuple[str, int, int] | None:
    """``bfloat16``/``float16``/``float32`` → None; ``4bit``, ``affine4``, ``affine4-g64``, ``mxfp4``,
    ``nvfp4``, ``mxfp8`` → (mode, bits, group_size)."""
    s = text.strip().lower()
    if s in ("float32", "bfloat16", "float16", "float"):
        return None
    gs = None
    if "-g" in s:
        s, g = s.split("-g", 1)
        gs = int(g)
    if s.endswith("bit"):
        s = "affine" + s[:-3]
    for mode in ("affine", "mxfp4", "nvfp4", "mxfp8"):
        if s.startswith(mode):
            rest = s[len(mode):]
            if mode in QUANT_FIXED_BITS:
                bits = QUANT_FIXED_BITS[mode]
                if rest:
                    raise ValueError(f"quantization {text!r}: {mode} has fixed bits")
            else:
                bits = int(rest) if rest else 4
            return mode, bits, gs or QUANT_DEFAULT_GS[mode]
    raise ValueError(f"unknown quantization {text!r} (float32, bfloat16, float16, affine4[-g64], mxfp4, nvfp4, mxfp8)")


def canonical_quant(text: str, dtype: str = "float32") -> str:
    q = parse_quant(text)
    if q is None:
        return dtype if text.strip().lower() == "float" else text.strip().lower()
    return dsp.quant_name(*q)


def build_layer(spec: LayerSpec, seed: int = 0) -> SwitchGLU:
    """A random SwitchGLU of ``spec`` (weights evaluated; quantized with mlx-lm's QuantizedSwitchLinear)."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU

    mx.random.seed(seed)
    layer = SwitchGLU(spec.D, spec.H, spec.E, activation=SwigluOAI() if spec.oai else SwiGLU(), bias=spec.bias)
    if spec.bias:
        for name in dsp._PROJS:
            p = getattr(layer, name)
            p.bias = mx.random.normal(p.bias.shape) * 0.05
    layer.set_dtype(getattr(mx, spec.dtype))
    q = parse_quant(spec.quant)
    if q is not None:
        mode, bits, gs = q
        nn.quantize(layer, group_size=gs, bits=bits, mode=mode,
                    class_predicate=lambda _p, m: hasattr(m, "to_quantized"))
    mx.eval(layer.parameters())
    return layer


def spec_of(module, k: int, dtype=None) -> LayerSpec:
    """The LayerSpec of an existing SwitchGLU (activation dtype: ``dtype``, else its scales' / weights' dtype)."""
    up = module.up_proj
    key = dsp.LayerKey.of(module)
    if dtype is None:
        dtype = up.scales.dtype if isinstance(up, QuantizedSwitchLinear) else up.weight.dtype
    from mlx_lm.models.activations import SwigluOAI

    return LayerSpec(key.D, key.H, key.E, int(k), key.quant, dsp.dtype_name(dtype), "bias" in up,
                     isinstance(module.activation, SwigluOAI))


# ----------------------------------------------------------------------------------------------- inputs


def make_inputs(m: int, spec: LayerSpec, seed: int = 0):
    """Random activations (M, D) and top-k expert indices (M, k), k distinct experts per token, uniform."""
    key = mx.random.key(seed * 7919 + m)
    kx, ki = mx.random.split(key)
    x = (mx.random.normal((m, spec.D), key=kx)).astype(getattr(mx, spec.dtype))
    scores = mx.random.uniform(shape=(m, spec.E), key=ki)
    idx = mx.argpartition(-scores, kth=spec.k - 1, axis=-1)[:, : spec.k].astype(mx.uint32)
    mx.eval(x, idx)
    return x, idx


# ------------------------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    name: str
    plan: Plan
    cached: bool = False  # dequantized experts pre-computed (needs the memory)


def candidates(quantized: bool, blocks=DEFAULT_BLOCKS, dequant: bool = True) -> list[Candidate]:
    out = [Candidate("mlx-lm", MLX_LM), Candidate("unsorted", Plan("unsorted")), Candidate("sorted", Plan("sorted"))]
    out += [Candidate(f"blocked{r}", Plan("blocked", r)) for r in blocks]
    if quantized and dequant:
        layouts = [Plan("unsorted", 0, True), Plan("sorted", 0, True)] + [Plan("blocked", r, True) for r in blocks]
        out += [Candidate(str(p), p) for p in layouts if p.layout != "unsorted"]  # uncached: large M only
        out += [Candidate(f"{p}+cache", p, True) for p in layouts]
    return out


def _timed(fn) -> tuple[float, mx.array]:
    t0 = time.perf_counter()
    out = fn()
    mx.eval(out)
    return time.perf_counter() - t0, out


#: max |ours - mlx-lm| / max |mlx-lm| accepted from a candidate (accumulation order only), by activation dtype
#: (float32 allows for TF32 tensor-core products on a GPU, as in multi-row matmuls there)
TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2, "float16": 2e-2}


def relative_error(out: mx.array, ref: mx.array) -> float:
    out32, ref32 = out.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.max(mx.abs(out32 - ref32)).item() / (mx.max(mx.abs(ref32)).item() + 1e-12))


@dataclass
class Timings:
    """What :func:`measure` timed: seconds per candidate at every M of one expert shape (the job's options are
    :class:`~mlx_fun.dispatch.tune_options.Measurement`)."""

    ms: list
    times: dict  # candidate name -> list of seconds (None where not measured)
    spec: LayerSpec
    device: str
    errors: dict = None  # candidate name -> worst relative error vs mlx-lm seen, or a failure message


def measure(
    layer,
    spec: LayerSpec,
    ms=DEFAULT_MS,
    blocks=DEFAULT_BLOCKS,
    dequant: bool = True,
    warmup: int = 1,
    min_repeats: int = 3,
    max_repeats: int = 100,
    target_s: float = 0.25,
    slow_call_s: float = 5.0,
    prune: float = 3.0,
    progress: Callable[[str], None] | None = None,
    seed: int = 0,
) -> Timings:
    """Time every candidate at every M on ``layer`` (interleaved rounds, median).

    The first call of each candidate at each M is also checked against mlx-lm's output: a candidate that
    fails (an op the backend lacks) or differs by more than :data:`TOLERANCE` is dropped for good.
    """
    quantized = any(isinstance(getattr(layer, n), QuantizedSwitchLinear) for n in dsp._PROJS)
    cands = candidates(quantized, blocks, dequant)
    tol = TOLERANCE.get(spec.dtype, 5e-2)
    rng = random.Random(seed)
    cache = None
    if any(c.cached for c in cands):
        cache = [dsp._dequantize(getattr(layer, n), getattr(mx, spec.dtype)) for n in dsp._PROJS]
        mx.eval([w for w in cache if w is not None])
    times: dict[str, list] = {c.name: [] for c in cands}
    errors: dict[str, object] = {}
    alive = {c.name: True for c in cands}
    strikes = {c.name: 0 for c in cands}
    last_ratio: dict[str, float] = {}
    for m in ms:
        x, idx = make_inputs(m, spec, seed)
        baseline = str(mlx_lm_plan(m, spec.k))  # "unsorted" or "sorted": always measured, never pruned
        fns = {}
        for c in cands:
            if c.name == "mlx-lm" or (not alive[c.name] and c.name != baseline):
                continue
            fns[c.name] = (lambda p=c.plan, w=(cache if c.cached else None): dsp.run_plan(layer, x, idx, p, w))
        # the baseline first: its output is the reference
        order = [baseline] + [n for n in fns if n != baseline]
        first, ref = {}, None
        for name in order:
            if progress:
                progress(f"M={m} {name}")
            try:
                for _ in range(max(0, warmup - 1)):
                    mx.eval(fns[name]())
                first[name], out = _timed(fns[name])  # warm-up call (graph building, allocation)
            except Exception as e:  # noqa: BLE001 - a plan this backend cannot run
                if name == baseline:
                    raise
                errors[name], alive[name] = f"failed: {type(e).__name__}: {e}"[:200], False
                continue
            if ref is None:
                ref = out
                continue
            err = relative_error(out, ref)
            if isinstance(errors.get(name, 0.0), float):
                errors[name] = max(errors.get(name, 0.0), err)
            if err > tol:
                errors[name], alive[name] = f"mismatch: relative error {err:.3g} > {tol:g} at M={m}", False
                first.pop(name)
            del out
        del ref
        fns = {name: fn for name, fn in fns.items() if name in first}
        samples = {name: [] for name in fns}
        slowest = max(first.values())
        repeats = 1 if slowest > slow_call_s else int(
            min(max_repeats, max(min_repeats, math.ceil(target_s / max(slowest, 1e-6)))))
        names = list(fns)
        for _ in range(repeats):
            rng.shuffle(names)  # a fresh order each round: no path always runs right after the same other one
            for name in names:
                samples[name].append(_timed(fns[name])[0])
        med = {name: statistics.median(v) for name, v in samples.items()}
        med["mlx-lm"] = med[baseline]
        best = min(med.values())
        for c in cands:
            t = med.get(c.name)
            times[c.name].append(t)
            if t is None or c.name in ("mlx-lm", baseline):
                continue
            ratio = t / best
            if ratio >= prune and ratio >= last_ratio.get(c.name, 0.0) * 0.95:  # slow and not catching up
                strikes[c.name] += 1
            else:
                strikes[c.name] = 0
            last_ratio[c.name] = ratio
            if strikes[c.name] >= 2:
                alive[c.name] = False
    return Timings(list(ms), times, spec, device_description(), errors)


# -------------------------------------------------------------------------------------------------- bands


#: a plan must also beat mlx-lm's by this much absolute time (timer / launch noise of sub-millisecond calls)
MIN_GAIN_S = 2e-5


def _choose(meas: Timings, i: int, allowed: list[str], margin: float, prev: str | None,
            stick: float) -> tuple[Plan, str]:
    base = meas.times["mlx-lm"][i]
    best_name, best_t = "mlx-lm", base
    for name in allowed:
        t = meas.times[name][i]
        if t is not None and t < best_t:
            best_name, best_t = name, t
    if best_name == "mlx-lm" or best_t > (1.0 - margin) * base or base - best_t < MIN_GAIN_S:
        return MLX_LM, "mlx-lm"
    # near-ties: keep the previous M's plan (fewer bands, no flip-flop between block sizes on noise)
    if prev and prev != "mlx-lm" and prev in allowed:
        t_prev = meas.times[prev][i]
        if t_prev is not None and t_prev <= (1.0 + stick) * best_t and t_prev <= (1.0 - margin) * base:
            best_name = prev
    plan = Plan.parse(best_name.replace("+cache", ""))
    if plan == mlx_lm_plan(meas.ms[i], meas.spec.k):
        return MLX_LM, "mlx-lm"
    return plan, best_name


def build_bands(meas: Timings, cached: bool, margin: float = 0.05, smooth: float = 0.10,
                stick: float = 0.10) -> list[tuple[int, Plan]]:
    """Bands from the measurement: uncached (native + per-call dequant) or cached (native + cached dequant)."""
    bad = {n for n, e in (meas.errors or {}).items() if not isinstance(e, (int, float))}  # failed / mismatched
    allowed = [n for n in meas.times if n != "mlx-lm" and n not in bad
               and (n.endswith("+cache") == cached or not n.startswith("dequant"))]
    picks = []
    for i in range(len(meas.ms)):
        picks.append(_choose(meas, i, allowed, margin, picks[-1][1] if picks else None, stick))
    plans = [p for p, _ in picks]
    names = [n for _, n in picks]
    # smooth isolated winners whose neighbours agree and are within `smooth` of them
    for i in range(1, len(plans) - 1):
        if plans[i - 1] == plans[i + 1] != plans[i]:
            neighbour = names[i - 1]
            t_n = meas.times[neighbour][i] if neighbour != "mlx-lm" else meas.times["mlx-lm"][i]
            t_w = meas.times[names[i]][i] if names[i] != "mlx-lm" else meas.times["mlx-lm"][i]
            if t_n is not None and t_w is not None and t_n <= (1.0 + smooth) * t_w:
                plans[i], names[i] = plans[i - 1], names[i - 1]
    bands: list[tuple[int, Plan]] = []
    for i, plan in enumerate(plans):
        if bands and bands[-1][1] == plan:
            continue
        start = 1 if not bands else int(math.floor(math.sqrt(meas.ms[i - 1] * meas.ms[i]))) + 1
        bands.append((start, plan))
    return bands or [(1, MLX_LM)]


def entry_from(meas: Timings, margin: float = 0.05) -> Entry:
    """A table entry (backend, quant, shape, bands[, bands_cached]) with the measurement attached."""
    spec = meas.spec
    quantized = dsp.is_quant_key(spec.quant)
    bands = build_bands(meas, cached=False, margin=margin)
    bands_cached = build_bands(meas, cached=True, margin=margin) if quantized else None
    if bands_cached == bands:
        bands_cached = None
    measured = {
        "m": meas.ms,
        "ms": {name: [None if t is None else round(t * 1e3, 4) for t in ts] for name, ts in meas.times.items()},
    }
    if meas.errors:
        measured["max_rel_err"] = {name: (float(f"{e:.3g}") if isinstance(e, float) else e)
                                   for name, e in meas.errors.items()}
    extra = {
        "dtype": spec.dtype,
        "device": meas.device,
        "mlx": mx.__version__,
        "mlx_lm": _mlx_lm_version(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "measured": measured,
    }
    return Entry(dsp.backend_name(), spec.quant, spec.D, spec.H, spec.E, spec.k, bands, bands_cached,
                 source="tuned", extra=extra)


def _mlx_lm_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-lm")
    except Exception:
        return "?"


def measurement_of(entry: Entry) -> Timings:
    """The measurement stored in a tuned entry (to re-derive bands without measuring again)."""
    meas = entry.extra["measured"]
    times = {name: [None if t is None else t / 1e3 for t in ts] for name, ts in meas["ms"].items()}
    spec = LayerSpec(entry.D, entry.H, entry.E, entry.k, entry.quant, entry.extra.get("dtype", "float32"))
    return Timings(list(meas["m"]), times, spec, entry.extra.get("device", ""), meas.get("max_rel_err"))


def rebanded(entry: Entry, margin: float = 0.05) -> Entry:
    """``entry`` with its bands re-derived from its stored measurement (same metadata)."""
    new = entry_from(measurement_of(entry), margin=margin)
    new.backend, new.extra = entry.backend, dict(entry.extra)
    return new


def tune(layer, spec: LayerSpec, margin: float = 0.05, **kwargs) -> Entry:
    """Measure ``layer`` and return its table entry."""
    return entry_from(measure(layer, spec, **kwargs), margin=margin)


def speedup_table(entry: Entry) -> list[tuple[int, str, float, float]]:
    """(M, chosen plan, mlx-lm ms, chosen ms) per measured M of a tuned entry (uncached bands)."""
    meas = entry.extra.get("measured") or {}
    rows = []
    for i, m in enumerate(meas.get("m", [])):
        plan = entry.plan(m)
        base = meas["ms"]["mlx-lm"][i]
        name = "mlx-lm" if plan == MLX_LM else str(plan)
        t = meas["ms"].get(name, [None] * (i + 1))[i]
        rows.append((m, name, base, t if t is not None else float("nan")))
    return rows
