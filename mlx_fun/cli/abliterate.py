"""``mlx-fun abliterate``: parses, calls :func:`mlx_fun.jobs.abliterate.run`, prints the measured effect."""

from __future__ import annotations

import dataclasses

import click

from ..jobs import abliterate
from .common import echo_err, friendly_errors, text_table
from .options import job_kwargs, job_options


@click.command("abliterate", short_help="Remove the refusal direction from residual writers (MoE-aware), measured.")
@job_options(abliterate.run)
@friendly_errors
def command(**kwargs):
    """Remove the refusal direction (Arditi et al. 2024) from every matrix that writes into the residual stream
    of the chosen decoder layers — attention output, dense MLP and shared-expert down projections, every routed
    expert's down projection (gpt-oss: with its bias) and, single direction, the token embedding — in their output
    space, W <- W - w d d^T W, with d = normalise(mean harmful - mean benign residual) over the harmful prompts the
    model refuses and the benign ones it answers, one d per refusal phrasing. Each further round measures what
    still separates them on the abliterated model and removes that too. Quantized weights are re-quantized with their own bits, group size
    and mode, holding the removed directions through the rounding. Reports the refusal rate and the benign
    first-token KL before and after.

    \b
    Example (the bundled refusing chat model, held-out evaluation prompts):
      mlx-fun abliterate --model data/tiny-moe-chat --harmful-dataset data/safety/harmful_train.jsonl \\
          --benign-dataset data/safety/benign_train.jsonl --eval-harmful-dataset data/safety/harmful_test.jsonl \\
          --eval-benign-dataset data/safety/benign_test.jsonl --output runs/abliterated --seed 0
    """
    kwargs = job_kwargs(abliterate.run, kwargs)
    kwargs["settings"] = dataclasses.replace(kwargs["settings"], progress=True)
    show(abliterate.run(**kwargs, log=echo_err))


def show(result) -> None:
    if result.trials:
        rows = [[",".join(map(str, t.layers)), f"{t.weight:g}", _source(t.direction_layer), str(t.rounds),
                 f"{t.harmful_refusal:.1%}", f"{t.benign_refusal:.1%}", f"{t.benign_kl:.4f}",
                 f"{t.held_out_kl:.4f}"] for t in result.trials]
        click.echo(text_table(["layers", "weight", "direction", "rounds", "harmful refusal", "benign refusal",
                               "benign KL", "held-out KL"], rows))
    for n, r in enumerate(result.rounds, 1):
        said = ", ".join(f"'{k}' ({v})" for k, v in r.phrasings.items())
        click.echo(f"round {n}: {len(r.dirs)} direction(s) ({said}), norm {r.norm:.3f}, from the {r.refused} of "
                   f"{r.harmful} harmful prompts the model refused and the {r.answered} of {r.benign} benign prompts "
                   "it answered")
    from ..core.sizes import format_bytes

    b, a = result.before, result.after
    streamed = ", one decoder layer at a time" if result.streamed else ""
    click.echo(f"Wrote {result.output} (layers {','.join(map(str, result.layers))}, weight {result.weight:g}, "
               f"direction {_source(result.direction_layer)}, {len(result.rounds)} round(s); "
               f"harmful refusal {b.harmful_refusal:.1%} -> {a.harmful_refusal:.1%}, benign refusal "
               f"{b.benign_refusal:.1%} -> {a.benign_refusal:.1%}, benign first-token KL {a.benign_kl:.4f}; "
               f"KL {a.held_out_kl:.4f} on {result.kl_set} (--max-kl bounds it); "
               f"abliteration_metadata.json beside the weights; peak memory {format_bytes(result.peak_bytes)}"
               f"{streamed})")


def _source(layer: int | None) -> str:
    return "per-layer" if layer is None else f"layer {layer}"
