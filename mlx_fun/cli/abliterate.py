"""``mlx-fun abliterate``: parses, calls :func:`mlx_fun.jobs.abliterate.run`, prints the measured effect."""

from __future__ import annotations

import click

from .common import FiniteFloat, echo_err, friendly_errors, model_option, text_table


@click.command("abliterate", short_help="Remove the refusal direction from residual writers (MoE-aware), measured.")
@model_option
@click.option("--harmful-dataset", required=True, type=click.Path(),
              help="Harmful prompts: JSONL (chats are read with their generation prompt) or a directory.")
@click.option("--benign-dataset", required=True, type=click.Path(), help="Benign prompts, same formats.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Model directory to write.")
@click.option("--layers", default="auto", show_default=True,
              help="auto (top half by the un-normalised direction norm), all, or start-end (e.g. 1-3).")
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
@click.option("--max-samples", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prompts per dataset for the directions.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Truncate every prompt to this many tokens.")
@click.option("--text-key", default="content", show_default=True, help="JSON key of plain-text JSONL lines.")
@click.option("--seed", type=int, default=None, help="Seed for the random subsets of prompts.")
@click.option("--eval-harmful-dataset", type=click.Path(), default=None,
              help="Held-out harmful prompts for the refusal rate (default: --harmful-dataset).")
@click.option("--eval-benign-dataset", type=click.Path(), default=None,
              help="Held-out benign prompts for the refusal rate and first-token KL (default: --benign-dataset).")
@click.option("--eval-samples", type=click.IntRange(min=1), default=64, show_default=True,
              help="Evaluation prompts per set.")
@click.option("--search", type=click.IntRange(min=0), default=0, show_default=True,
              help="Try this many (layers, weight) settings and keep the fewest refusals under --max-kl.")
@click.option("--max-kl", type=FiniteFloat(0.0, min_open=True), default=0.5, show_default=True,
              help="Largest benign first-token KL (nats) --search accepts.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Prompts per forward pass while capturing.")
@click.option("--force", is_flag=True, default=False, help="Replace a non-empty --output directory.")
@friendly_errors
def command(**kwargs):
    """Remove the refusal direction (Arditi et al. 2024) from every matrix that writes into the residual stream
    of the chosen decoder layers — attention output, dense MLP and shared-expert down projections, and every
    routed expert's down projection (gpt-oss: with its bias) — in their output space, W <- W - w d d^T W, with
    d = normalise(mean harmful - mean benign residual) of that layer. Quantized weights are re-quantized with
    their own bits, group size and mode. Reports the refusal rate and the benign first-token KL before and after.

    \b
    Example (the bundled refusing chat model, held-out evaluation prompts):
      mlx-fun abliterate --model data/tiny-moe-chat --harmful-dataset data/safety/harmful_train.jsonl \\
          --benign-dataset data/safety/benign_train.jsonl --eval-harmful-dataset data/safety/harmful_test.jsonl \\
          --eval-benign-dataset data/safety/benign_test.jsonl --output abliterated --seed 0
    """
    from ..jobs import abliterate

    show(abliterate.run(**kwargs, progress=True, log=echo_err))


def show(result) -> None:
    if result.trials:
        rows = [[",".join(map(str, t.layers)), f"{t.weight:g}", f"{t.harmful_refusal:.1%}", f"{t.benign_refusal:.1%}",
                 f"{t.benign_kl:.4f}"] for t in result.trials]
        click.echo(text_table(["layers", "weight", "harmful refusal", "benign refusal", "benign KL"], rows))
    b, a = result.before, result.after
    click.echo(f"Wrote {result.output} (layers {','.join(map(str, result.layers))}, weight {result.weight:g}; "
               f"harmful refusal {b.harmful_refusal:.1%} -> {a.harmful_refusal:.1%}, benign refusal "
               f"{b.benign_refusal:.1%} -> {a.benign_refusal:.1%}, benign first-token KL {a.benign_kl:.4f}; "
               "abliteration_metadata.json beside the weights)")
