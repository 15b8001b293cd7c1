"""``mlx-fun prune``: parses, calls :func:`mlx_fun.jobs.prune.run`, prints."""

from __future__ import annotations

import click

from ..jobs import prune
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("prune", short_help="Remove the least salient experts (REAP) and save an mlx-lm model.")
@job_options(prune.run)
@friendly_errors
def command(**kwargs):
    """Prune MODEL's routed experts by saliency and write a standard mlx-lm directory to OUTPUT.

    \b
    Examples (on the bundled model; runs/filtered_experts.json: docs/guide/commands.md):
      mlx-fun prune --model data/tiny-moe --saliency runs/code.npz --n-prune 8 --output runs/pruned
      mlx-fun prune --model data/tiny-moe --saliency runs/code.npz --n-prune 8 --model-wide \\
          --ignore-experts "0,1,30..31" --output runs/pruned-wide
      mlx-fun prune --model data/tiny-moe --expert-list runs/filtered_experts.json --output runs/pruned-list

    Router rows, correction biases and every expert projection (quantized or not) are sliced; shared
    experts are kept. The result loads with plain mlx_lm.load(); reap_metadata.json records the kept experts.
    It streams: tensors are copied or sliced from the model's files one at a time (never decoded), so memory
    stays near the largest tensor, however large the model.
    """
    show(prune.run(**job_kwargs(prune.run, kwargs), progress=True, log=echo_err))


def show(result) -> None:
    """Experts before → after per layer (and which were removed), then the size on disk."""
    E = result.num_experts
    click.echo(f"{'layer':>6} {'experts':>12}  removed")
    for pos, layer in enumerate(result.moe_layers):
        kept = set(result.keep_map.get(pos, range(E)))
        removed = [e for e in range(E) if e not in kept]
        shown = ", ".join(map(str, removed[:12])) + (f", … (+{len(removed) - 12})" if len(removed) > 12 else "")
        click.echo(f"{layer:>6} {E:>5} → {len(kept):<4}  {shown}")
    echo_size_summary(result.model, result.output, E, result.kept, result.seconds)


def echo_size_summary(model, output, n_before: int, n_after: int, elapsed: float, note: str = "") -> None:
    """The closing lines of prune and merge: size on disk before → after, experts per layer, time (and ``note``:
    merge's peak memory)."""
    from ..output.model_dir import dir_size
    from ..core.writer import fmt_bytes

    before, after = dir_size(model), dir_size(output)
    click.echo(f"size on disk: {fmt_bytes(before)} → {fmt_bytes(after)} ({after / max(before, 1):.0%}); "
               f"{n_before} → {n_after} experts per layer; {elapsed:.1f} s{note}")
    click.echo(f"Wrote {output}")
