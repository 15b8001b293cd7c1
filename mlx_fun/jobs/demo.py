"""The ``demo`` job: the main job end to end on the bundled trained model, offline, in about a minute.

prepare data → collect → prune → smoke-test → eval, each step the real job, announced with the command line that
runs it by hand (``mlx-fun <command> <flags>``, the flags being the job's keyword arguments and the fields of its
option groups), then a table of sizes and perplexities written to ``summary.md``.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable

import click

from ..core.options import Opt
from ..core.ranges import FiniteFloat
from ..errors import UserError, param
from ..observe.saliency import METRICS
from ..settings import grouped
from .common import Log, job, quiet

MARKER = ".mlx-fun-demo"
STEPS = ("collect", "prune", "smoke-test", "eval")


@dataclass
class DemoResult:
    output: Path
    summary: str  # the markdown table (model, experts/layer, size, ppl per domain)
    agreement: str  # KL and top-1 agreement per domain
    report: dict  # eval.json
    metric: str = "reap"
    calibration: str = "code"
    times: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def command_line(name: str, kwargs: dict) -> str:
    """The shell command that runs job ``name`` with ``kwargs`` (keyword → ``--flag``, lists repeat the flag)."""
    parts = ["mlx-fun", name]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts += [flag] if value else []
        elif isinstance(value, (list, tuple)):
            for v in value:
                parts += [flag, str(v)]
        elif value is not None:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


def check_workdir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"{param('output')} {out} is a file; give a directory (default ./mlx-fun-demo).")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise UserError(f"{param('output')} {out} is a non-empty directory that the demo did not create; "
                        f"choose another {param('output')} so nothing of yours is overwritten.")


@job
def run(
    *,
    model: Annotated[str | Path | None, Opt("Model to compress [default: the bundled trained model "
                                            "data/tiny-moe].")] = None,
    output: Annotated[str | Path, Opt("Working directory for the data, saliency, pruned model and reports (reused "
                                      "on re-runs).")] = "mlx-fun-demo",
    prune_fraction: Annotated[float, Opt("Fraction of each layer's routed experts to remove.",
                                         type=FiniteFloat(min=0.0, max=1.0, min_open=True, max_open=True))] = 0.25,
    metric: Annotated[str, Opt("Saliency metric for pruning.", type=click.Choice(METRICS))] = "reap",
    calibration: Annotated[str, Opt("Domain of the calibration text (both domains are evaluated).",
                                    type=click.Choice(["code", "prose"]))] = "code",
    max_samples: Annotated[int, Opt("Calibration samples (evaluation uses half as many per domain).",
                                    type=click.IntRange(min=1))] = 64,
    max_tokens: Annotated[int, Opt("Tokens per sample.", type=click.IntRange(min=16))] = 512,
    announce: Callable[[str, str], None] | None = None,
    report: Callable[[str, object], None] | None = None,
    progress: bool = False,
    log: Log = quiet,
) -> DemoResult:
    """Compress ``model`` (default: the bundled ``data/tiny-moe``) with REAP in ``output`` and measure the cost.

    ``announce(title, command_line)`` is called before each step and ``report(name, result)`` after it (the CLI
    prints them); ``log`` gets the status lines of the steps."""
    from ..datasets import corpus
    from ..core import writer
    from ..adapters import adapter_class
    from ..model.io import bundled_model_dir, read_config
    from ..output.model_dir import dir_size
    from . import collect, eval as eval_job, prune, smoke_test

    out = Path(output)
    writer.check_output_path(out, kind="dir", force=True)  # not an input, nor around one (its own rule next)
    check_workdir(out)
    model_dir = Path(model) if model is not None else bundled_model_dir()
    n_experts = adapter_class(read_config(model_dir)).config_num_experts(read_config(model_dir))
    n_prune = max(1, round(n_experts * prune_fraction))
    out.mkdir(parents=True, exist_ok=True)
    # the work directory is the demo's own (check_workdir): each run replaces what the last one wrote there
    writer.write_text(out / MARKER, "created by mlx-fun demo; safe to delete\n", force=True)
    start = time.perf_counter()
    times: dict[str, float] = {}

    t0 = time.perf_counter()
    data_dir = out / "corpus"
    manifest = corpus.ensure_prepared(data_dir, sources=corpus.ALWAYS, max_samples=512, max_eval_samples=128,
                                      force=True)
    times["prepare"] = time.perf_counter() - t0
    if report is not None:
        report("prepare", manifest)

    saliency, pruned, eval_json = out / "saliency.npz", out / "pruned", out / "eval.json"
    steps = [
        (f"1/4 collect saliency on {calibration}", "collect", collect.run, dict(
            model=str(model_dir), dataset=str(corpus.domain_file(data_dir, calibration, "train")),
            output=str(saliency), max_samples=max_samples, max_tokens=max_tokens, seed=0, force=True)),
        (f"2/4 prune {n_prune} of {n_experts} experts per layer by {metric}", "prune", prune.run, dict(
            model=str(model_dir), saliency=str(saliency), n_prune=n_prune, metric=metric, output=str(pruned),
            force=True)),
        ("3/4 smoke-test the pruned model", "smoke-test", smoke_test.run, dict(  # a base model: code, no chat
            model=str(pruned), prompt="def read_config(path):", ignore_chat_template=True, max_tokens=48)),
        ("4/4 eval pruned vs original on held-out text", "eval", eval_job.run, dict(
            model=str(pruned), reference=str(model_dir),
            dataset=[f"{d}={corpus.domain_file(data_dir, d, 'test')}" for d in corpus.ALWAYS],
            max_samples=max(1, max_samples // 2), max_tokens=max_tokens, output=str(eval_json), force=True)),
    ]
    extra = {"collect": {"progress": progress}, "eval": {"progress": progress}}
    for title, name, step, kwargs in steps:
        if announce is not None:
            announce(title, command_line(name, kwargs))
        t0 = time.perf_counter()
        result = step(**grouped(step, {**kwargs, **extra.get(name, {})}), log=log)
        times[name] = time.perf_counter() - t0
        if report is not None:
            report(name, result)

    ev = json.loads(eval_json.read_text())
    summary, agreement = _tables(ev, n_experts, n_prune, dir_size(model_dir), dir_size(pruned))
    writer.write_text(out / "summary.md", f"# mlx-fun demo\n\n{metric} pruning of {n_prune}/{n_experts} experts per "
                      f"layer, calibrated on {calibration}.\n\n{summary}\n\n{agreement}\n\nStep times (s): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + "\n", force=True)
    return DemoResult(out, summary, agreement, ev, metric, calibration, times, time.perf_counter() - start)


def _tables(ev: dict, n_experts: int, n_prune: int, original: int, pruned: int) -> tuple[str, str]:
    """``(summary, agreement)``: the markdown table of sizes and perplexities (original and pruned, sizes in bytes)
    and the KL / top-1 agreement line, from the eval report ``ev``."""
    domains = list(ev["datasets"])
    header = ["model", "experts/layer", "size"] + [f"{d} ppl" for d in domains]
    table = [header]
    for label, experts, size, key in (("original", n_experts, original, "ref_ppl"),
                                      ("pruned", n_experts - n_prune, pruned, "ppl")):
        table.append([label, str(experts), f"{size / 2**20:.1f} MiB"] + [f"{ev['datasets'][d][key]:.2f}" for d in domains])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    agreement = ", ".join(f"{d}: KL {ev['datasets'][d]['kl']:.4f} nats, top-1 agreement "
                          f"{ev['datasets'][d]['top1_agreement']:.1%}" for d in domains)
    return "\n".join(lines), agreement
