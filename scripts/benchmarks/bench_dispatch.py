#!/usr/bin/env python3
"""Benchmark one MoE expert layer: mlx-lm's SwitchGLU against mlx-fun's runtime dispatch, M = 1 … 4096 tokens.

    python -m scripts.benchmarks.bench_dispatch [--small] [--quant float --quant 4bit]
                                                [--output docs/benchmarks/dispatch_<backend>.md]

Layer: Qwen3-30B-A3B-shaped (D 2048, H 768, E 128, top-8) by default, ``--small`` D 512, H 256, E 64, top-8;
float weights (float32 on the CPU, whose ``gather_mm`` is float32-only; bfloat16 on a GPU) and 4-bit affine
(group 64, activations of the same float dtype). Random weights, random distinct top-k experts per token.

For each M the same layer and inputs run through, in interleaved rounds (each call forced with ``mx.eval`` and
timed on its own, median kept, after warm-up calls; the order is shuffled every round):

- ``mlx-lm``: ``SwitchGLU.__call__`` (sorts when ``indices.size >= 64``);
- ``other``: mlx-lm's other path (unsorted where it sorts and vice versa) — where it is faster, the fixed rule
  is wrong;
- ``ours``: ``DispatchedSwitchGLU`` with the shipped table (+ the user table, + ``--dispatch-table``), no cache;
- ``ours+cache`` (4-bit only): the same with the dequantized experts cached (``--dequant-cache``).

Prints a markdown table (also written to ``--output``, naming the device); the last line is
``min_speedup=<..> max_speedup=<..>`` of ``ours`` vs ``mlx-lm`` over every row (a row's speedup: the median
over rounds of the ratio of the two times measured in the same round). Needs only mlx, mlx-lm and
mlx_fun. Progress goes to stderr, unbuffered.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time

FULL = (2048, 768, 128, 8)
SMALL = (512, 256, 64, 8)
DEFAULT_MS = "1,2,4,8,16,32,64,128,512,2048,4096"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--small", action="store_true", help="D 512, H 256, E 64, k 8 instead of Qwen3-30B-A3B's shape.")
    ap.add_argument("--shape", default=None, help="D,H,E,k (overrides --small).")
    ap.add_argument("--ms", default=DEFAULT_MS, help="Token counts M.")
    ap.add_argument("--quant", action="append", default=None,
                    help="float and/or 4bit (repeatable; default both). Any tune-dispatch --quant name works too.")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="Float / activation dtype (default: float32 on CPU, bfloat16 on a GPU).")
    ap.add_argument("--dispatch-table", default=None, help="Extra table over the shipped and user tables.")
    ap.add_argument("--no-user-table", action="store_true", help="Ignore the user table (shipped + --dispatch-table only).")
    ap.add_argument("--dequant-cache", default="64GiB", help="Budget for the ours+cache column (4-bit); 0 drops it.")
    ap.add_argument("--warmup", type=int, default=2, help="Untimed calls per path and M (1 for calls over 2 s).")
    ap.add_argument("--min-repeats", type=int, default=3)
    ap.add_argument("--max-repeats", type=int, default=200)
    ap.add_argument("--target-s", type=float, default=0.5, help="Aim for this much timed work per path and M.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="Write the markdown report here.")
    ap.add_argument("--blas", choices=("fast", "as-is"), default="fast",
                    help="Linux CPU: re-exec with OpenBLAS preloaded as `mlx-fun` does (fast), or not.")
    args = ap.parse_args()

    if args.blas == "fast":
        from mlx_fun.runtime.blas import maybe_reexec

        maybe_reexec()

    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_fun.dispatch import experts as dsp
    from mlx_fun.dispatch.tune import LayerSpec, build_layer, canonical_quant, device_description, make_inputs, parse_quant

    backend = dsp.backend_name()
    dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    D, H, E, k = (int(v) for v in args.shape.split(",")) if args.shape else (SMALL if args.small else FULL)
    ms = [int(v) for v in args.ms.split(",") if v]
    quants = args.quant or ["float", "4bit"]
    budget = dsp.parse_bytes(args.dequant_cache)
    table = dsp.load_table(args.dispatch_table, user=not args.no_user_table)
    device = device_description()
    try:
        from mlx_fun.runtime.blas import blas_status

        blas = blas_status() if backend == "cpu" else ""
    except Exception:
        blas = ""
    log(f"device: {device}  mlx {mx.__version__}  layer D{D} H{H} E{E} k{k}  dtype {dtype}  {blas}")

    rows = []
    entries_used = []
    t_start = time.perf_counter()
    for q in quants:
        quant = canonical_quant(q if q != "float" else dtype, dtype)
        is_q = parse_quant(quant) is not None
        spec = LayerSpec(D, H, E, k, quant, dtype)
        log(f"building {spec.label()} ...")
        layer = build_layer(spec, seed=args.seed)
        dsp.install(layer, table)
        entry, how = dsp.state_of(layer).entry(k)
        entries_used.append((spec.label(), entry.describe(), how))
        cached = None
        if is_q and budget > 0:
            # a second module sharing the weights, with the dequantized experts cached
            cached = build_layer(spec, seed=args.seed)
            cached.update(layer.parameters())
            rep = dsp.install(cached, table, dequant_cache_bytes=budget)
            if rep.cached_layers == 0:
                log(f"  ours+cache: {rep.cache_note or 'not cached'}")
                cached = None
            else:
                log(f"  ours+cache: {dsp.format_bytes(rep.cache_bytes)} of dequantized experts cached")
        for m in ms:
            x, idx = make_inputs(m, spec, seed=args.seed)
            base_plan = dsp.mlx_lm_plan(m, k)
            other_plan = dsp.SORTED if base_plan == dsp.UNSORTED else dsp.UNSORTED
            ours_plan = dsp.state_of(layer).plans.get((m, k)) or dsp.state_of(layer).resolve(m, k)
            fns = {
                "mlx-lm": lambda: SwitchGLU.__call__(layer, x, idx),
                "other": lambda p=other_plan: dsp.run_plan(layer, x, idx, p),
                "ours": lambda: layer(x, idx),
            }
            cache_plan = None
            if cached is not None:
                cache_plan = dsp.state_of(cached).plans.get((m, k)) or dsp.state_of(cached).resolve(m, k)
                fns["ours+cache"] = lambda: cached(x, idx)
            med, errs = time_all(fns, mx, args)
            row = {"quant": quant, "m": m, "mlx_plan": str(base_plan), "other_plan": str(other_plan),
                   "ours_plan": str(ours_plan), "cache_plan": str(cache_plan) if cache_plan else None,
                   "err": max(v for n, v in errs.items() if n.startswith("ours")), **med}
            rows.append(row)
            extra = f"  ours+cache {med['ours+cache'] * 1e3:9.3f} ms ({cache_plan})" if "ours+cache" in med else ""
            log(f"  {quant:12s} M={m:5d}  mlx-lm {med['mlx-lm'] * 1e3:9.3f} ms ({base_plan})  other "
                f"{med['other'] * 1e3:9.3f} ms  ours {med['ours'] * 1e3:9.3f} ms ({ours_plan})  "
                f"x{med['x:ours']:.2f}{extra}  [{time.perf_counter() - t_start:.0f}s]")
        layer = cached = fns = None  # free this layer before building the next
        mx.clear_cache()

    text = render(rows, args, device, blas, dtype, (D, H, E, k), entries_used, mx.__version__)
    print(text, flush=True)
    if args.output:
        from mlx_fun.core.writer import write_text

        write_text(args.output, text, force=True)  # a report page this script regenerates
        log(f"wrote {args.output}")
    speedups = [r["x:ours"] for r in rows]
    print(f"min_speedup={min(speedups):.3f} max_speedup={max(speedups):.3f}", flush=True)
    return 0


def time_all(fns: dict, mx, args) -> dict:
    """Median seconds per path (and the relative error of each path's output vs mlx-lm's): warm-up calls, then
    rounds in a shuffled order."""
    from mlx_fun.dispatch.tune import relative_error

    first, outs = {}, {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        outs[name] = fn()
        mx.eval(outs[name])
        first[name] = time.perf_counter() - t0
    errs = {name: relative_error(out, outs["mlx-lm"]) for name, out in outs.items() if name != "mlx-lm"}
    del outs
    slowest = max(first.values())
    warm = 0 if slowest > 2.0 else max(0, args.warmup - 1)
    for name, fn in fns.items():
        for _ in range(warm):
            mx.eval(fn())
    repeats = int(min(args.max_repeats, max(args.min_repeats, math.ceil(args.target_s / max(slowest, 1e-6)))))
    samples = {name: [] for name in fns}
    names = list(fns)
    rng = random.Random(args.seed)
    for _ in range(repeats):
        rng.shuffle(names)  # a fresh order each round: no path always runs right after the same other one
        for name in names:
            t0 = time.perf_counter()
            mx.eval(fns[name]())
            samples[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in samples.items()}
    # speedups as the median of per-round ratios (paired in time, so clock drift cancels)
    for name in fns:
        if name != "mlx-lm":
            med[f"x:{name}"] = statistics.median(a / b for a, b in zip(samples["mlx-lm"], samples[name]))
    return med, errs


def render(rows, args, device, blas, dtype, shape, entries_used, mlx_version) -> str:
    D, H, E, k = shape
    has_cache = any(r.get("ours+cache") for r in rows)
    lines = [
        f"# MoE expert dispatch: mlx-lm SwitchGLU vs mlx-fun ({device})",
        "",
        f"- device: {device}; mlx {mlx_version}" + (f"; {blas}" if blas else ""),
        f"- layer: D {D}, H {H}, E {E}, top-{k} (SwiGLU); float dtype {dtype}; random weights and routing",
        f"- command: `python -m scripts.benchmarks.bench_dispatch {' '.join(sys.argv[1:])}`",
        "- per-layer time of one call (median of repeats in shuffled rounds after warm-up, each forced with "
        "mx.eval); speedup: median over rounds of mlx-lm time / ours time in the same round; "
        "max rel err: max |ours - mlx-lm| / max |mlx-lm| of the outputs (both ours columns)",
        "- `mlx-lm`: its SwitchGLU (sorts when M*k >= 64); `other`: mlx-lm's other path; `ours`: the dispatch "
        "with the shipped table, no cache" + ("; `ours+cache`: with the dequantized experts cached" if has_cache else ""),
        "",
        "Table entries used:",
        "",
    ]
    for label, desc, how in entries_used:
        lines.append(f"- {label}: {how} — {desc}")
    lines.append("")
    head = "| weights | M | mlx-lm ms | other ms | rule | ours plan | ours ms | speedup |"
    sep = "|---|---:|---:|---:|---|---|---:|---:|"
    if has_cache:
        head += " ours+cache plan | ours+cache ms | speedup |"
        sep += "---|---:|---:|"
    head += " max rel err |"
    sep += "---:|"
    lines += [head, sep]
    for r in rows:
        base, other, ours = r["mlx-lm"], r["other"], r["ours"]
        rule = "ok" if other >= 0.95 * base else f"wrong ({base / other:.2f}x)"
        line = (f"| {r['quant']} | {r['m']} | {base * 1e3:.3f} ({r['mlx_plan']}) | {other * 1e3:.3f} | {rule} | "
                f"{r['ours_plan']} | {ours * 1e3:.3f} | {r['x:ours']:.2f}x |")
        if has_cache:
            c = r.get("ours+cache")
            line += (f" {r['cache_plan']} | {c * 1e3:.3f} | {r['x:ours+cache']:.2f}x |" if c else " | | |")
        line += f" {r['err']:.1e} |"
        lines.append(line)
    speedups = [r["x:ours"] for r in rows]
    wrong = [r for r in rows if r["other"] < 0.95 * r["mlx-lm"]]
    lines += [
        "",
        f"min_speedup={min(speedups):.3f} max_speedup={max(speedups):.3f}",
    ]
    if wrong:
        worst = min(r["x:ours"] for r in wrong)
        lines.append(f"rows where mlx-lm's fixed rule picks the slower of its two paths: {len(wrong)}; "
                     f"min speedup of ours there: {worst:.2f}x")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
