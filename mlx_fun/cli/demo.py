"""``mlx-fun demo``: the main job end to end on the bundled trained model, offline, in about a minute.

Each step is the real command, invoked in-process with the options it prints, so the demo doubles as a
recipe: prepare data → collect → prune → smoke-test → eval, then a table of sizes and perplexities.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import click

from .. import writer
from ..errors import UserError
from .common import FiniteFloat, friendly_errors

MARKER = ".mlx-fun-demo"


def _cmdline(cmd: click.Command, params: dict) -> str:
    """The shell command line that runs ``cmd`` with ``params`` (Python parameter names → option flags)."""
    flags = {p.name: p.opts[0] for p in cmd.params}
    parts = ["mlx-fun", cmd.name]
    for key, value in params.items():
        flag = flags[key]
        if isinstance(value, bool):
            if value:
                parts.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                parts += [flag, str(v)]
        elif value is not None:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


def _step(ctx, title: str, name: str, params: dict, times: dict) -> None:
    from . import main

    cmd = main.get_command(ctx, name)
    click.secho(f"\n== {title}", bold=True)
    click.echo(f"$ {_cmdline(cmd, params)}")
    start = time.perf_counter()
    ctx.invoke(cmd, **params)
    times[name] = time.perf_counter() - start


def _fmt_mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _echo_blas() -> None:
    """Which BLAS the CPU runs on, and what a slow one costs (measured on 2 cores: 52 s vs 287 s)."""
    from ..blas import blas_status

    status = blas_status()
    click.echo(status)
    if "preloaded" not in status and "not needed" not in status:
        click.echo("Warning: with the reference BLAS this demo takes about 5x longer (287 s instead of 52 s on "
                   "2 CPU cores); `mlx-fun doctor` shows the BLAS in use.", err=True)


def _check_workdir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; give a directory (default ./mlx-fun-demo).")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise UserError(f"--output {out} is a non-empty directory that the demo did not create; "
                        f"choose another --output so nothing of yours is overwritten.")


@click.command("demo", short_help="Run the whole job (collect → prune → smoke-test → eval) on the bundled model.")
@click.option("--model", type=click.Path(), default=None,
              help="Model to compress [default: the bundled trained model data/tiny-moe].")
@click.option("--output", type=click.Path(), default="mlx-fun-demo", show_default=True,
              help="Working directory for the data, saliency, pruned model and reports (reused on re-runs).")
@click.option("--prune-fraction", type=FiniteFloat(min=0.0, max=1.0, min_open=True, max_open=True),
              default=0.25, show_default=True, help="Fraction of each layer's routed experts to remove.")
@click.option("--metric", type=click.Choice(["reap", "ean", "freq", "weighted_freq"]), default="reap",
              show_default=True, help="Saliency metric for pruning.")
@click.option("--calibration", type=click.Choice(["code", "prose"]), default="code", show_default=True,
              help="Domain of the calibration text (both domains are evaluated).")
@click.option("--max-samples", type=click.IntRange(min=1), default=64, show_default=True,
              help="Calibration samples (evaluation uses half as many per domain).")
@click.option("--max-tokens", type=click.IntRange(min=16), default=512, show_default=True,
              help="Tokens per sample.")
@friendly_errors
def demo_cmd(model, output, prune_fraction, metric, calibration, max_samples, max_tokens):
    """Compress the bundled trained MoE with REAP and measure what it cost — no arguments, no network.

    \b
    1. prepare  standard-library text (code + prose, train/validation/test) into OUTPUT/corpus
    2. collect  expert saliency on the calibration domain's train split
    3. prune    the least salient 25% of experts per layer (REAP) → OUTPUT/pruned
    4. smoke-test the pruned model (greedy)
    5. eval     pruned vs original on held-out code and prose (perplexity, KL, top-1 agreement)

    Every step prints the command it runs, so you can re-run any of them by hand on your own model.

    \b
    Example:
      mlx-fun demo
    """
    from .. import corpus
    from ..io import bundled_model_dir, dir_size, read_config

    ctx = click.get_current_context()
    out = Path(output)
    _check_workdir(out)
    model_dir = Path(model) if model is not None else bundled_model_dir()
    config = read_config(model_dir)
    text_cfg = config.get("text_config", config)
    n_experts = next((text_cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                      if k in text_cfg), None)
    if n_experts is None:
        raise UserError(f"{model_dir} does not look like an MoE model (no expert count in config.json).")
    n_prune = max(1, round(n_experts * prune_fraction))
    _echo_blas()
    out.mkdir(parents=True, exist_ok=True)
    writer.write_text(out / MARKER, "created by mlx-fun demo; safe to delete\n")
    start = time.perf_counter()
    times: dict[str, float] = {}

    click.secho("== prepare data", bold=True)
    data_dir = out / "corpus"
    t0 = time.perf_counter()
    manifest = corpus.ensure_prepared(data_dir, sources=corpus.ALWAYS, max_samples=512, max_eval_samples=128)
    times["prepare"] = time.perf_counter() - t0
    for name, entry in manifest["domains"].items():
        counts = ", ".join(f"{s} {v['samples']}" for s, v in entry["splits"].items())
        click.echo(f"{name}: {entry['source']} ({counts} samples)")

    saliency = out / "saliency.npz"
    pruned = out / "pruned"
    eval_json = out / "eval.json"
    _step(ctx, f"1/4 collect saliency on {calibration}", "collect", {
        "model": str(model_dir), "dataset": str(corpus.domain_file(data_dir, calibration, "train")),
        "output": str(saliency), "max_samples": max_samples, "max_tokens": max_tokens, "seed": 0,
    }, times)
    _step(ctx, f"2/4 prune {n_prune} of {n_experts} experts per layer by {metric}", "prune", {
        "model": str(model_dir), "saliency": str(saliency), "n_prune": n_prune, "metric": metric,
        "output": str(pruned), "force": True,
    }, times)
    _step(ctx, "3/4 smoke-test the pruned model", "smoke-test", {
        "model": str(pruned), "prompt": "def read_config(path):", "max_tokens": 48,
    }, times)
    _step(ctx, "4/4 eval pruned vs original on held-out text", "eval", {
        "model": str(pruned), "reference": str(model_dir),
        "datasets": [f"{d}={corpus.domain_file(data_dir, d, 'test')}" for d in corpus.ALWAYS],
        "max_samples": max(1, max_samples // 2), "max_tokens": max_tokens, "output": str(eval_json),
    }, times)

    report = json.loads(eval_json.read_text())
    rows = [("original", n_experts, dir_size(model_dir), "ref_ppl"), ("pruned", n_experts - n_prune,
                                                                      dir_size(pruned), "ppl")]
    domains = list(report["datasets"])
    header = ["model", "experts/layer", "size"] + [f"{d} ppl" for d in domains]
    table = [header]
    for label, experts, size, key in rows:
        table.append([label, str(experts), _fmt_mb(size)] + [f"{report['datasets'][d][key]:.2f}" for d in domains])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    agreement = ", ".join(
        f"{d}: KL {report['datasets'][d]['kl']:.4f} nats, top-1 agreement {report['datasets'][d]['top1_agreement']:.1%}"
        for d in domains)
    total = time.perf_counter() - start
    summary = "\n".join(lines)
    click.secho(f"\n== summary ({metric} pruning, calibrated on {calibration}; {total:.0f} s)", bold=True)
    click.echo(summary)
    click.echo(agreement)
    writer.write_text(out / "summary.md", 
        f"# mlx-fun demo\n\n{metric} pruning of {n_prune}/{n_experts} experts per layer, calibrated on "
        f"{calibration}.\n\n{summary}\n\n{agreement}\n\nStep times (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + "\n")
    click.echo(f"Outputs in {out}/ (pruned model, saliency.npz, eval.json, summary.md)")


COMMANDS = [demo_cmd]
