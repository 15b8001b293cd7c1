#!/usr/bin/env python3
"""Benchmark `merge` (REAM): is the cost linear in depth?

    python -m scripts.benchmarks.bench_merge [--layers 4] [--experts 32] [--n-prune 8] [--hidden 256]
                                             [--expert-width 128] [--samples 16] [--tokens 128] [--bits 4]
                                             [--alignment hungarian] [--repeats 2] [--rss-samples 16]

Builds random qwen3_moe models (``mlx_fun.testing.tiny`` helpers, in memory, no files) with L and 2L decoder layers and
otherwise identical shapes, and times ``merge_model`` in-process on each (the same calibration tokens, the same
saliency per layer, best of ``--repeats``, each repeat on a freshly built model). A small merge runs first so
one-time costs (kernel compilation, scipy import) do not land in the L measurement. Printed per depth: total
merge seconds, seconds per layer (total / L), the mean of the per-MoE-layer times the merge reports and, for
scale, one plain forward pass of the unmerged model over the same calibration tokens. On Linux CPU the script
re-execs itself once with OpenBLAS preloaded, like the ``mlx-fun`` launcher.

``merge_depth_ratio=<t(2L) / t(L)>``: 2.0 means exactly linear in depth; a merge that re-ran the whole model for
every layer would approach 2 · (2L + 1) / (L + 1) ≈ 3.6 for L = 4 and grow with L.

Memory (``--rss-samples``, default 16; 0 skips): on the bundled model ``data/tiny-moe`` with samples of 2,048
random tokens (batch 8, the default token budget), each in a fresh process: the peak RSS of
a plain trunk forward over the samples (``model.model``, the hidden states merge needs, through the forward
engine) and of ``merge_model`` on the same samples. One layer's captures = the hidden states carried between
layers (tokens × hidden, float32) plus the capture tap's tokens (input, logits, routing). The last line is
``merge_rss_ratio=<merge's peak − its loaded base) / (forward's peak − its base + one layer's captures)>`` (goal
≤ 1; the merge base includes importing scipy.optimize for the Hungarian alignment, about 45 MB of code).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from scripts.lib.paths import BUNDLED
from scripts.lib.procs import root_env


def build(args, layers: int, seed: int = 0):
    from mlx_fun.adapters import get_adapter
    from mlx_fun.testing.tiny import build_model, quantize, tiny_config

    cfg = tiny_config(
        "qwen3_moe",
        vocab_size=1024,
        num_hidden_layers=layers,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_width,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
    )
    model = build_model(cfg, seed=seed)
    if args.bits:
        model, cfg = quantize(model, cfg, bits=args.bits)
    return model, get_adapter(model, cfg)


def time_merge(args, layers: int, samples, saliency_row) -> tuple[float, dict]:
    import numpy as np

    from mlx_fun.rewrite.merge import merge_model
    from mlx_fun.rewrite.merge_options import Ream
    from mlx_fun.experts.selection import Selection
    from mlx_fun.datasets.calibration import Calibration

    best, best_meta = float("inf"), None
    for rep in range(args.repeats):
        model, adapter = build(args, layers)
        sal = np.tile(saliency_row, (len(adapter.moe_layers()), 1))
        t0 = time.perf_counter()
        meta = merge_model(
            model, adapter, samples, saliency=sal, selection=Selection(n_prune=args.n_prune),
            ream=Ream(alignment=args.alignment, max_group_size=args.max_group_size, saliency_source="file",
                      max_similarity_tokens=args.similarity_tokens, max_alignment_tokens=args.alignment_tokens),
            calibration=Calibration(seed=0),
        )  # fmt: skip
        elapsed = time.perf_counter() - t0
        if elapsed < best:
            best, best_meta = elapsed, meta
    return best, best_meta


def time_forward(args, layers: int, samples) -> float:
    """One plain forward pass of the unmerged model over the calibration samples (batches of 8), for scale."""
    from mlx_fun.model import engine

    model, _ = build(args, layers)
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.run(model, samples, lambda chunk, out: chunk.eval(out), batch_size=8)
        best = min(best, time.perf_counter() - t0)
    return best


def rss_child(kind: str, n_samples: int) -> None:
    """In a fresh process: load the bundled model, run ``kind`` (forward | merge); print peak and base RSS."""
    import resource

    import mlx.core as mx
    import numpy as np

    from mlx_fun.model import engine
    from mlx_fun.adapters import get_adapter
    from mlx_fun.datasets.samples import pad_id
    from mlx_fun.model.io import load_model
    from mlx_fun.rewrite.merge import merge_model
    from mlx_fun.rewrite.merge_options import Ream
    from mlx_fun.datasets.calibration import Calibration
    from mlx_fun.experts.selection import Selection

    model, tokenizer, config = load_model(BUNDLED)
    adapter = get_adapter(model, config)
    if kind == "merge":
        import scipy.optimize  # noqa: F401 - the Hungarian alignment's module: code, counted in the base
    base = _rss_now()
    rng = np.random.default_rng(0)  # full-length samples: the calibration sample's are short
    samples = [rng.integers(3, config["vocab_size"], 2048).tolist() for _ in range(n_samples)]
    if kind == "forward":
        engine.run(model.model, samples, lambda chunk, out: chunk.eval(out), batch_size=8, pad_id=pad_id(tokenizer))
    elif kind == "merge":
        scores = np.random.default_rng(0).random((len(adapter.moe_layers()), adapter.num_experts))
        merge_model(model, adapter, samples, saliency=scores, selection=Selection(n_prune=adapter.num_experts // 4),
                    ream=Ream(saliency_source="file"), calibration=Calibration(seed=0, batch_size=8),
                    pad_id=pad_id(tokenizer))
    tokens = engine.total_tokens(samples)
    captures = tokens * config["hidden_size"] * 4 + 512 * (config["hidden_size"] + adapter.num_experts + 2 * adapter.top_k) * 4
    mx.synchronize()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, base, tokens, captures)


def _rss_now() -> int:
    """Resident bytes of this process now (Linux /proc; elsewhere the peak so far)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def measure_rss(n_samples: int) -> None:
    import subprocess

    peaks, bases = {}, {}
    for kind in ("forward", "merge"):
        out = subprocess.run([sys.executable, "-m", __spec__.name, "--rss-child", kind, "--rss-samples",
                              str(n_samples)], env=root_env(), capture_output=True, text=True, check=True).stdout.split()
        peaks[kind], bases[kind], tokens, captures = (int(v) for v in out[-4:])
    mib = 2 ** 20
    print(f"# peak RSS on data/tiny-moe, {n_samples} samples, {tokens:,} tokens: plain forward "
          f"{peaks['forward'] / mib:.0f} MiB (loaded: {bases['forward'] / mib:.0f}), merge {peaks['merge'] / mib:.0f} "
          f"MiB (loaded, scipy.optimize imported: {bases['merge'] / mib:.0f}); one layer's captures "
          f"{captures / mib:.1f} MiB")
    print(f"merge_rss_vs_forward={peaks['merge'] / peaks['forward']:.3f}")
    # what the run adds to the loaded process: merge ≤ forward + one layer's captures is the goal
    print(f"merge_rss_ratio={(peaks['merge'] - bases['merge']) / (peaks['forward'] - bases['forward'] + captures):.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="L: the smaller model's decoder layers (the other has 2L)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--n-prune", type=int, default=8)
    p.add_argument("--max-group-size", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--expert-width", type=int, default=128)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--similarity-tokens", type=int, default=512)
    p.add_argument("--alignment-tokens", type=int, default=256)
    p.add_argument("--alignment", choices=["hungarian", "greedy", "none"], default="hungarian")
    p.add_argument("--bits", type=int, default=None, help="quantize the random model (affine) first")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rss-samples", type=int, default=16, help="samples of the memory measurement (0: skip it)")
    p.add_argument("--rss-child", choices=["forward", "merge"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    from mlx_fun.runtime.blas import maybe_reexec

    maybe_reexec()  # Linux CPU: OpenBLAS preloaded, as the `mlx-fun` launcher does
    if args.rss_child:
        rss_child(args.rss_child, args.rss_samples)
        return 0

    import mlx.core as mx
    import numpy as np

    from mlx_fun.runtime.blas import blas_status

    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 1024, args.tokens).tolist() for _ in range(args.samples)]
    saliency_row = rng.random(args.experts)
    print(f"# {blas_status()}; mlx {mx.__version__}; device {mx.default_device()}")
    print(f"# qwen3_moe hidden {args.hidden}, {args.experts} experts × width {args.expert_width}, top-{args.top_k}, "
          f"{'float32' if not args.bits else f'{args.bits}-bit'}; n_prune {args.n_prune}, max group "
          f"{args.max_group_size}, alignment {args.alignment}; {args.samples} samples × {args.tokens} tokens")

    # warm-up: compile kernels, import scipy
    warm = argparse.Namespace(**{**vars(args), "repeats": 1})
    time_merge(warm, 1, samples[:2], saliency_row)

    results = {}
    print(f"{'layers':>6} {'merge s':>9} {'s/layer':>9} {'mean MoE-layer s':>17} {'forward s':>10}")
    for L in (args.layers, 2 * args.layers):
        t, meta = time_merge(args, L, samples, saliency_row)
        per = list(meta["layer_seconds"].values())
        results[L] = t
        print(f"{L:>6} {t:>9.3f} {t / L:>9.3f} {sum(per) / len(per):>17.3f} {time_forward(args, L, samples):>10.3f}")
    ratio = results[2 * args.layers] / results[args.layers]
    print(f"merge_seconds_per_layer={results[2 * args.layers] / (2 * args.layers):.4f}")
    print(f"merge_depth_ratio={ratio:.3f}")
    if args.rss_samples:
        measure_rss(args.rss_samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
