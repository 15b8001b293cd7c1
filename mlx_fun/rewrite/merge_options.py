"""The option group of ``merge`` (:func:`mlx_fun.jobs.merge.run`): :class:`Ream`, how experts are merged.

Kept apart from :mod:`mlx_fun.rewrite.merge` (which re-exports it) because every job's signature is built when
:mod:`mlx_fun.jobs` is imported, and the merging code imports MLX and the adapters: this module imports neither::

    from mlx_fun import jobs
    from mlx_fun.rewrite.merge_options import Ream
    from mlx_fun.experts.selection import Selection
    jobs.merge.run(model="data/tiny-moe", saliency="s.npz", selection=Selection(n_prune=8), output="merged",
                   dataset="data/calibration_sample.jsonl", ream=Ream(alignment="greedy"))
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import click

from ..core.options import Group, option
from ..errors import UserError, param

SIMILARITY_MODES = ("gated", "average")
ALIGNMENTS = ("hungarian", "greedy", "none")
SALIENCY_SOURCES = ("layerwise", "file")


def check_max_group_size(max_group_size) -> None:
    """A whole number of experts >= 1, else a one-line ``UserError`` naming the parameter."""
    if isinstance(max_group_size, bool) or not isinstance(max_group_size, numbers.Integral) or max_group_size < 1:
        raise UserError(f"{param('max_group_size')} must be a whole number of experts >= 1, got {max_group_size!r}.")


@dataclass(frozen=True)
class Ream(Group):
    """How experts are merged (the option group ``ream`` of the merge job; fields = its options).

    ``similarity_mode``: ``gated`` or ``average`` (:mod:`mlx_fun.rewrite.merge`, step 3); ``alignment``:
    ``hungarian``, ``greedy`` or ``none`` (step 5); ``max_group_size``: most experts per group, centroid included
    (REAM's C); ``max_similarity_tokens``: tokens every expert is run on to measure similarity;
    ``max_alignment_tokens``: the first that many of them align neurons; ``saliency_source``: ``layerwise`` (REAM's
    saliency measured during the merge, :mod:`mlx_fun.rewrite.ream_saliency`) or ``file`` (the collect file's,
    chosen up front). Every field is checked when a Ream is
    built (:class:`mlx_fun.core.options.Group`); :func:`mlx_fun.rewrite.merge.merge_model` takes it whole."""

    similarity_mode: str = option(
        "gated", "gated: cosine of router-probability-weighted mean outputs; average: of plain mean outputs. Both are "
        "averaged with the router-logit correlation.", type=click.Choice(SIMILARITY_MODES))
    alignment: str = option("hungarian", "Neuron alignment before averaging: hungarian (optimal), greedy (fast), none.",
                            type=click.Choice(ALIGNMENTS))
    max_group_size: int = option(
        16, "Most experts per merge group, centroid included (REAM's C). Never exceeded: a size too small for the "
        "centroids to hold every expert is refused, naming the smallest that works.", type=click.IntRange(min=1))
    max_similarity_tokens: int = option(512, "Tokens (random subset) on which every expert is run to measure "
                                        "similarity.", type=click.IntRange(min=1))
    max_alignment_tokens: int = option(256, "Tokens (subset of the similarity tokens) whose activations align "
                                       "neurons.", type=click.IntRange(min=1))

    saliency_source: str = option(
        "layerwise", "Where the centroids and the merge weights come from. layerwise (REAM's own): each layer's "
        "saliency is measured during the merge on the hidden states of the already merged layers (router "
        "probability squared times expert output norm, over the tokens routed to the expert); --saliency is not "
        "read. file: the --saliency file's metric, ranked up front (--model-wide, --metric and --ignore-experts "
        "apply). --expert-list fixes the centroids in both; the saliency then only weights the averages.",
        type=click.Choice(SALIENCY_SOURCES))

    def __post_init__(self) -> None:
        check_max_group_size(self.max_group_size)  # its own message ("a whole number of experts") before the range's
        super().__post_init__()


__all__ = ["ALIGNMENTS", "Ream", "SALIENCY_SOURCES", "SIMILARITY_MODES", "check_max_group_size"]
