"""``mlx-fun prune``: REAP expert pruning into a new mlx-lm model directory."""

from __future__ import annotations

import time
from pathlib import Path

import click

from .. import __version__
from ..errors import UserError
from .collect import check_supported
from .common import friendly_errors, metric_option, model_option


def echo_size_summary(model, output, n_before: int, n_after: int, elapsed: float) -> None:
    """The closing lines of prune and merge: size on disk before → after, experts per layer, time."""
    from ..io import dir_size

    before, after = dir_size(model), dir_size(output)
    click.echo(f"size on disk: {_fmt_size(before)} → {_fmt_size(after)} ({after / max(before, 1):.0%}); "
               f"{n_before} → {n_after} experts per layer; {elapsed:.1f} s")
    click.echo(f"Wrote {output}")


def _fmt_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


@click.command("prune", short_help="Remove the least salient experts (REAP) and save an mlx-lm model.")
@model_option
@click.option("--saliency", type=click.Path(), default=None, help="Saliency .npz from `mlx-fun collect`.")
@click.option("--expert-list", type=click.Path(), default=None,
              help="JSON/CSV list of experts to keep or remove per layer (see README); replaces --saliency/--n-prune.")
@click.option("--output", required=True, type=click.Path(), help="Directory for the pruned model (must not be --model).")
@click.option("--n-prune", type=click.IntRange(min=0), default=None,
              help="Experts to remove: per layer, or expert indices removed from every layer with --model-wide.")
@metric_option()
@click.option("--strategy", type=click.Choice(["bottom", "strided"]), default="bottom", show_default=True,
              help="bottom: remove the lowest scores; strided: spread removals over the saliency range.")
@click.option("--model-wide", is_flag=True, help="Remove the same expert indices from every layer (column sums).")
@click.option("--min-experts-per-layer", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --model-wide: never keep fewer experts than this in a layer.")
@click.option("--ignore-experts", default=None, help='With --model-wide: indices never pruned, e.g. "0,1,250..255".')
@click.option("--safety-map", type=click.Path(), default=None, help="Safety report JSON listing experts per layer (format: README, Report files).")
@click.option("--safety-mode", type=click.Choice(["protect", "target"]), default=None,
              help="protect: never prune safety-critical experts; target: prune them first.")
@click.option("--domain-map", type=click.Path(), default=None, help="Domain report JSON listing experts per layer (format: README, Report files).")
@click.option("--domain-mode", type=click.Choice(["protect"]), default=None, help="protect: never prune domain experts.")
@click.option("--force", is_flag=True, help="Replace --output if it exists and is not empty.")
@friendly_errors
def prune_cmd(model, saliency, expert_list, output, n_prune, metric, strategy, model_wide, min_experts_per_layer,
              ignore_experts, safety_map, safety_mode, domain_map, domain_mode, force):
    """Prune MODEL's routed experts by saliency and write a standard mlx-lm directory to OUTPUT.

    \b
    Examples (on the bundled model; filtered_experts.json is the README's expert-list example):
      mlx-fun prune --model data/tiny-moe --saliency code.npz --n-prune 8 --output pruned
      mlx-fun prune --model data/tiny-moe --saliency code.npz --n-prune 8 --model-wide \\
          --ignore-experts "0,1,30..31" --output pruned-wide
      mlx-fun prune --model data/tiny-moe --expert-list filtered_experts.json --output pruned-list

    Router rows, correction biases and every expert projection (quantized or not) are sliced; shared
    experts are kept. The result loads with plain mlx_lm.load(); reap_metadata.json records the kept experts.
    """
    from ..adapters import get_adapter
    from .. import writer
    from ..io import load_model, params_nbytes, write_model_dir
    from ..rewrite.prune import prune_model
    from ..saliency import SaliencyAccumulator
    from ..expert_files import load_expert_list, load_report_experts, merge_expert_sets
    from ..selection import check_keep_counts, parse_expert_ranges, select_experts

    check_supported(model)
    if (saliency is None) == (expert_list is None):
        raise UserError("give exactly one of --saliency (with --n-prune) or --expert-list.")
    if saliency is not None and n_prune is None:
        raise UserError("--saliency needs --n-prune (how many experts to remove).")
    if expert_list is not None and n_prune is not None:
        raise UserError("--expert-list already says which experts to remove; drop --n-prune.")
    if (safety_map is None) != (safety_mode is None):
        raise UserError("--safety-map and --safety-mode go together.")
    if (domain_map is None) != (domain_mode is None):
        raise UserError("--domain-map and --domain-mode go together.")
    if ignore_experts is not None and not model_wide:
        raise UserError("--ignore-experts only works with --model-wide.")
    for flag, path in (("--saliency", saliency), ("--expert-list", expert_list), ("--safety-map", safety_map),
                       ("--domain-map", domain_map)):
        if path is not None and not Path(path).exists():
            raise UserError(f"{flag} {path} does not exist; check the path.")

    inputs = {"--model": model, "--saliency": saliency, "--expert-list": expert_list, "--safety-map": safety_map,
              "--domain-map": domain_map}
    start = time.perf_counter()
    with writer.output(output, kind="dir", inputs=inputs, force=force) as res:
        mdl, tokenizer, config = load_model(model, lazy=True)
        adapter = get_adapter(mdl, config)
        moe_layers = adapter.moe_layers()
        E = adapter.num_experts
        if expert_list is not None:
            keep_map = load_expert_list(expert_list, len(moe_layers), E, moe_layers)
            metric_used = "expert-list"
        else:
            acc = SaliencyAccumulator.load(saliency)
            for warning in acc.check_matches(adapter):
                click.echo(f"Warning: {warning}", err=True)
            protected_sets, targeted = [], None
            if safety_map is not None:
                safety = load_report_experts(safety_map, "safety", moe_layers, E)
                if safety_mode == "protect":
                    protected_sets.append(safety)
                else:
                    targeted = safety
            if domain_map is not None:
                protected_sets.append(load_report_experts(domain_map, "domain", moe_layers, E))
            protected = merge_expert_sets(*protected_sets) if protected_sets else None
            keep_map = select_experts(
                acc.scores(metric),
                n_prune,
                top_k=adapter.top_k,
                strategy=strategy,
                model_wide=model_wide,
                min_experts_per_layer=min_experts_per_layer,
                ignore_experts=parse_expert_ranges(ignore_experts) if ignore_experts else None,
                protected=protected,
                targeted=targeted,
                groups=adapter.groups,
                moe_layer_indices=moe_layers,
            )
            metric_used = metric
        for warning in check_keep_counts(keep_map, E, adapter.top_k, groups=adapter.groups, moe_layer_indices=moe_layers):
            click.echo(f"Warning: {warning}", err=True)

        new_config = prune_model(adapter, keep_map)
        n_kept = adapter.num_experts
        metadata = {
            "original_num_experts": E,
            "pruned_num_experts": n_kept,
            "metric": metric_used,
            "keep_map": {str(moe_layers[pos]): [int(e) for e in kept] for pos, kept in sorted(keep_map.items())},
            "strategy": strategy if expert_list is None else None,
            "model_wide": model_wide,
            "n_prune": n_prune,
            "source": str(saliency or expert_list),
            "mlx_fun_version": __version__,
        }
        res.require_space(params_nbytes(mdl))
        click.echo(f"Saving pruned model to {output} ...", err=True)
        write_model_dir(res, mdl, new_config, source=model, metadata={"reap_metadata.json": metadata})

    elapsed = time.perf_counter() - start

    click.echo(f"{'layer':>6} {'experts':>12}  removed")
    for pos, layer in enumerate(moe_layers):
        kept = set(keep_map.get(pos, range(E)))
        removed = [e for e in range(E) if e not in kept]
        shown = ", ".join(map(str, removed[:12])) + (f", … (+{len(removed) - 12})" if len(removed) > 12 else "")
        click.echo(f"{layer:>6} {E:>5} → {len(kept):<4}  {shown}")
    echo_size_summary(model, output, E, n_kept, elapsed)


COMMANDS = [prune_cmd]
