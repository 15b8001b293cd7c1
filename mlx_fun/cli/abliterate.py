"""``mlx-fun abliterate``: parses, calls :func:`mlx_fun.jobs.abliterate.run`, prints the measured effect."""

from __future__ import annotations

import click

from .common import (
    SEED,
    FiniteFloat,
    dispatch_option,
    echo_err,
    force_option,
    friendly_errors,
    model_option,
    run_settings,
    take,
    text_table,
    token_budget_option,
)


@click.command("abliterate", short_help="Remove the refusal direction from residual writers (MoE-aware), measured.")
@model_option
@click.option("--harmful-dataset", required=True, type=click.Path(),
              help="Harmful prompts: JSONL (chats are read with their generation prompt) or a directory.")
@click.option("--benign-dataset", required=True, type=click.Path(), help="Benign prompts, same formats.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Model directory to write.")
@click.option("--layers", default="auto", show_default=True,
              help="Layers whose writers are orthogonalised: auto (single direction: all; per-layer: the top half by "
                   "the un-normalised direction norm), all, or start-end (e.g. 1-3).")
@click.option("--direction", type=click.Choice(["single", "per-layer"]), default="single", show_default=True,
              help="single: one direction (from --direction-layer) removed from every chosen layer and the token "
                   "embedding (Arditi et al.); per-layer: each layer's own direction from its own writers.")
@click.option("--direction-layer", type=click.IntRange(min=0), default=None,
              help="Decoder layer the single direction is measured after [default: the largest un-normalised "
                   "harmful - benign difference].")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Estimation rounds: each re-measures the directions on the model abliterated so far, from the "
                   "harmful prompts it still refuses and the benign ones it answers, and removes them too; stops "
                   "early when fewer than 2 refusals are left, and undoes a round that takes the benign capture "
                   "prompts' KL over --max-kl.")
@click.option("--phrasings", type=click.IntRange(min=1), default=4, show_default=True,
              help="Directions per round, one per refusal phrasing (refused prompts grouped by their reply's first "
                   "two words, 4 or more each); 1: one direction from all refused prompts.")
@click.option("--target", type=click.Choice(["all", "safety-experts", "dense-only"]), default="all",
              show_default=True,
              help="all: attention, dense MLP, shared and every routed expert; safety-experts: only the report's "
                   "routed experts; dense-only: everything but the routed experts.")
@click.option("--safety-map", type=click.Path(dir_okay=False), default=None,
              help="safety_report.json (with --target safety-experts).")
@click.option("--weight", type=FiniteFloat(0.0, 1.0, min_open=True), default=1.0, show_default=True,
              help="Fraction of the direction removed (W - weight * d d^T W).")
@click.option("--extraction-position", type=click.Choice(["last", "mean"]), default="last", show_default=True,
              help="Residual stream at each prompt's last token, or mean-pooled over its tokens.")
@click.option("--max-samples", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompts per dataset for the directions (later rounds use the ones still refused).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Truncate every prompt to this many tokens.")
@click.option("--text-key", default="content", show_default=True, help="JSON key of plain-text JSONL lines.")
@click.option("--seed", type=SEED, default=None, help="Seed for the random subsets of prompts.")
@click.option("--eval-harmful-dataset", type=click.Path(), default=None,
              help="Held-out harmful prompts for the refusal rate (default: --harmful-dataset).")
@click.option("--eval-benign-dataset", type=click.Path(), default=None,
              help="Held-out benign prompts for the refusal rate and first-token KL (default: --benign-dataset).")
@click.option("--eval-samples", type=click.IntRange(min=1), default=64, show_default=True,
              help="Evaluation prompts per set.")
@click.option("--search", type=click.IntRange(min=0), default=0, show_default=True,
              help="Try this many (layers, weight, direction layer) settings, each measured after every round, and keep "
                   "the fewest refusals under --max-kl.")
@click.option("--max-kl", type=FiniteFloat(0.0, min_open=True), default=0.5, show_default=True,
              help="Largest benign first-token KL (nats) --search accepts and a later round may reach; a first "
                   "round of several phrasings' directions over it falls back to one direction.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Prompts per forward pass while capturing (first-token log-probs: at least 16).")
@click.option("--refusal-filter/--no-refusal-filter", default=True, show_default=True,
              help="Take the directions from the harmful prompts the model refuses and the benign ones it answers "
                   "(Arditi et al.); a model that refuses none of them (or all benign ones) is refused with the "
                   "measured rates. --no-refusal-filter: from every prompt, whatever the model replies.")
@dispatch_option
@token_budget_option
@force_option("a non-empty --output directory")
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
          --eval-benign-dataset data/safety/benign_test.jsonl --output abliterated --seed 0
    """
    from ..jobs import abliterate
    from ..rewrite.abliterate_options import Estimate, Evaluation, Projection

    groups = dict(estimate=take(kwargs, Estimate), projection=take(kwargs, Projection),
                  evaluation=take(kwargs, Evaluation), settings=run_settings(kwargs))
    show(abliterate.run(**kwargs, **groups, log=echo_err))


def show(result) -> None:
    if result.trials:
        rows = [[",".join(map(str, t.layers)), f"{t.weight:g}", _source(t.direction_layer), str(t.rounds),
                 f"{t.harmful_refusal:.1%}", f"{t.benign_refusal:.1%}", f"{t.benign_kl:.4f}"] for t in result.trials]
        click.echo(text_table(["layers", "weight", "direction", "rounds", "harmful refusal", "benign refusal",
                               "benign KL"], rows))
    for n, r in enumerate(result.rounds, 1):
        said = ", ".join(f"'{k}' ({v})" for k, v in r.phrasings.items())
        click.echo(f"round {n}: {len(r.dirs)} direction(s) ({said}), norm {r.norm:.3f}, from the {r.refused} of "
                   f"{r.harmful} harmful prompts the model refused and the {r.answered} of {r.benign} benign prompts "
                   "it answered")
    b, a = result.before, result.after
    click.echo(f"Wrote {result.output} (layers {','.join(map(str, result.layers))}, weight {result.weight:g}, "
               f"direction {_source(result.direction_layer)}, {len(result.rounds)} round(s); "
               f"harmful refusal {b.harmful_refusal:.1%} -> {a.harmful_refusal:.1%}, benign refusal "
               f"{b.benign_refusal:.1%} -> {a.benign_refusal:.1%}, benign first-token KL {a.benign_kl:.4f}; "
               "abliteration_metadata.json beside the weights)")


def _source(layer: int | None) -> str:
    return "per-layer" if layer is None else f"layer {layer}"
