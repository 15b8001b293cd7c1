"""``mlx-fun merge``: REAM expert merging into a new mlx-lm model directory."""

from __future__ import annotations

import time
from pathlib import Path

import click

from .. import __version__
from ..errors import UserError
from .collect import check_supported, warn_past_context
from .common import friendly_errors, metric_option, model_option
from .prune import echo_size_summary


@click.command("merge", short_help="Merge experts into fewer centroids (REAM) and save an mlx-lm model.")
@model_option
@click.option("--saliency", type=click.Path(), default=None,
              help="Saliency .npz from `mlx-fun collect`: picks the centroids (with --n-prune) and weights the "
                   "averages (with --expert-list: only weights them).")
@click.option("--expert-list", type=click.Path(), default=None,
              help="JSON/CSV list of experts per layer; its kept experts are the centroids (replaces --n-prune).")
@click.option("--dataset", required=True, type=click.Path(),
              help="Calibration data for similarity and alignment (JSONL or a directory, as for collect).")
@click.option("--output", required=True, type=click.Path(),
              help="Directory for the merged model (must not be --model).")
@click.option("--n-prune", type=click.IntRange(min=0), default=None,
              help="Experts merged away per layer (or expert indices, with --model-wide); E - n centroids stay.")
@metric_option()
@click.option("--model-wide", is_flag=True, help="Keep the same centroid indices in every layer (column sums).")
@click.option("--min-experts-per-layer", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --model-wide: never keep fewer centroids than this in a layer.")
@click.option("--ignore-experts", default=None,
              help='With --model-wide: indices always kept as centroids, e.g. "0,1,250..255".')
@click.option("--similarity-mode", type=click.Choice(["gated", "average"]), default="gated", show_default=True,
              help="gated: cosine of router-probability-weighted mean outputs; average: of plain mean outputs. "
                   "Both are averaged with the router-logit correlation.")
@click.option("--alignment", type=click.Choice(["hungarian", "greedy", "none"]), default="hungarian", show_default=True,
              help="Neuron alignment before averaging: hungarian (optimal), greedy (fast), none.")
@click.option("--max-group-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Most experts per merge group, centroid included (REAM's C).")
@click.option("--max-samples", type=click.IntRange(min=1), default=64, show_default=True,
              help="Calibration samples (a random subset when the dataset has more).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Truncate every sample to this many tokens.")
@click.option("--max-similarity-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens (random subset) on which every expert is run to measure similarity.")
@click.option("--max-alignment-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Tokens (subset of the similarity tokens) whose activations align neurons.")
@click.option("--text-key", default="content", show_default=True, help="JSON key of plain-text JSONL lines.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Samples per forward pass while hidden states are pushed through the layers.")
@click.option("--seed", type=int, default=None, help="Seed for the sample subset and the token subsets.")
@click.option("--force", is_flag=True, help="Replace --output if it exists and is not empty.")
@friendly_errors
def merge_cmd(model, saliency, expert_list, dataset, output, n_prune, metric, model_wide, min_experts_per_layer,
              ignore_experts, similarity_mode, alignment, max_group_size, max_samples, max_tokens,
              max_similarity_tokens, max_alignment_tokens, text_key, batch_size, seed, force):
    """Merge MODEL's routed experts around the most salient ones (REAM) and write an mlx-lm directory to OUTPUT.

    \b
    Examples (on the bundled model; filtered_experts.json is the README's expert-list example):
      mlx-fun merge --model data/tiny-moe --saliency code.npz --n-prune 8 --dataset corpus/code/train.jsonl \\
          --output merged --max-samples 16 --max-tokens 512 --seed 42
      mlx-fun merge --model data/tiny-moe --expert-list filtered_experts.json --dataset corpus/code/train.jsonl \\
          --output merged-list --max-samples 16 --max-tokens 512

    Each non-centroid expert joins its most similar centroid (groups of at most --max-group-size); members'
    neurons are aligned to the centroid's and the group is averaged with saliency weights; the centroid's
    router row is kept. Layers are processed in order with hidden states carried forward through the merged
    layers (one pass over the calibration data). Quantized models stay quantized (same bits / group size /
    mode); the result is the size of a pruned model with the same expert count and loads with plain
    mlx_lm.load(). ream_metadata.json records centroids and groups.
    """
    from ..adapters import get_adapter
    from ..data import load_samples
    from ..data import pad_id as batch_pad_id
    from ..expert_files import load_expert_list
    from .. import writer
    from ..io import load_model, write_model_dir
    from ..rewrite.merge import merge_model, select_centroids
    from ..rewrite.prune import pruned_nbytes
    from ..saliency import SaliencyAccumulator
    from ..selection import check_keep_counts, parse_expert_ranges

    check_supported(model)
    if saliency is None and expert_list is None:
        raise UserError("give --saliency (with --n-prune) or --expert-list to choose the centroids.")
    if expert_list is None and n_prune is None:
        raise UserError("--saliency needs --n-prune (how many experts to merge away per layer).")
    if expert_list is not None and n_prune is not None:
        raise UserError("--expert-list already says which experts stay as centroids; drop --n-prune.")
    if ignore_experts is not None and not model_wide:
        raise UserError("--ignore-experts only works with --model-wide.")
    if model_wide and expert_list is not None:
        raise UserError("--model-wide selects centroids from --saliency; it does not apply to --expert-list.")
    for flag, path in (("--saliency", saliency), ("--expert-list", expert_list), ("--dataset", dataset)):
        if path is not None and not Path(path).exists():
            raise UserError(f"{flag} {path} does not exist; check the path.")

    inputs = {"--model": model, "--saliency": saliency, "--expert-list": expert_list, "--dataset": dataset}
    start = time.perf_counter()
    with writer.output(output, kind="dir", inputs=inputs, force=force) as res:
        click.echo(f"Loading {model} ...", err=True)
        mdl, tokenizer, config = load_model(model, lazy=True)
        adapter = get_adapter(mdl, config)
        moe_layers = adapter.moe_layers()
        E = adapter.num_experts
        scores = None
        if saliency is not None:
            acc = SaliencyAccumulator.load(saliency)
            for warning in acc.check_matches(adapter):
                click.echo(f"Warning: {warning}", err=True)
            scores = acc.scores(metric)
        if expert_list is not None:
            keep_map = load_expert_list(expert_list, len(moe_layers), E, moe_layers)
        else:
            keep_map = select_centroids(
                adapter, scores, n_prune, model_wide=model_wide, min_experts_per_layer=min_experts_per_layer,
                ignore_experts=parse_expert_ranges(ignore_experts, E) if ignore_experts else None,
            )  # fmt: skip
        for warning in check_keep_counts(keep_map, E, adapter.top_k, groups=adapter.groups, moe_layer_indices=moe_layers):
            click.echo(f"Warning: {warning}", err=True)
        n_kept = len(keep_map[0])
        if n_kept * max_group_size < E:
            click.echo(
                f"Warning: {n_kept} centroids × --max-group-size {max_group_size} < {E} experts: the experts left over "
                "join their most similar centroid, so some groups exceed the maximum size.",
                err=True,
            )

        samples = load_samples(dataset, tokenizer, max_samples=max_samples, max_tokens=max_tokens, text_key=text_key,
                               seed=seed)  # fmt: skip
        n_tokens = sum(len(s) for s in samples)
        click.echo(
            f"{adapter.model_type}: {len(moe_layers)} MoE layers × {E} experts → {n_kept} centroids; "
            f"{len(samples)} samples, {n_tokens:,} tokens; similarity {similarity_mode}, alignment {alignment}",
            err=True,
        )
        warn_past_context(samples, config, "--max-tokens")
        res.require_space(pruned_nbytes(adapter, n_kept))
        pad_id = batch_pad_id(tokenizer)
        metadata = merge_model(
            mdl, adapter, samples, keep_map=keep_map, saliency=scores, metric=metric,
            similarity_mode=similarity_mode, alignment=alignment, max_group_size=max_group_size,
            max_similarity_tokens=max_similarity_tokens, max_alignment_tokens=max_alignment_tokens, seed=seed,
            batch_size=batch_size, pad_id=pad_id, progress=True,
        )  # fmt: skip
        metadata.update(
            n_prune=n_prune,
            model_wide=model_wide,
            source=str(saliency or expert_list),
            expert_list=None if expert_list is None else str(expert_list),
            dataset=str(dataset),
            mlx_fun_version=__version__,
        )
        click.echo(f"Saving merged model to {output} ...", err=True)
        write_model_dir(res, mdl, adapter.config, source=model, metadata={"ream_metadata.json": metadata})

    elapsed = time.perf_counter() - start

    click.echo(f"{'layer':>6} {'experts':>12}  {'merged':>6}  {'largest':>7}  {'s':>6}")
    for layer in moe_layers:
        groups = metadata["group_map"][str(layer)]
        merged = sum(len(m) - 1 for m in groups.values())
        largest = max(len(m) for m in groups.values())
        secs = metadata["layer_seconds"][str(layer)]
        click.echo(f"{layer:>6} {E:>5} → {n_kept:<4}  {merged:>6}  {largest:>7}  {secs:>6.2f}")
    echo_size_summary(model, output, E, n_kept, elapsed)


COMMANDS = [merge_cmd]
