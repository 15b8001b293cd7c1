"""The option group of ``merge`` (:func:`mlx_fun.jobs.merge.run`): :class:`Ream`, how experts are merged.

Kept apart from :mod:`mlx_fun.rewrite.merge` (which re-exports it) because every job's signature is built when
:mod:`mlx_fun.jobs` is imported, and the merging code imports MLX and the adapters: this module imports nothing::

    from mlx_fun import jobs
    from mlx_fun.rewrite.merge_options import Ream
    from mlx_fun.experts.selection import Selection
    jobs.merge.run(model="data/tiny-moe", saliency="s.npz", selection=Selection(n_prune=8), output="merged",
                   dataset="data/calibration_sample.jsonl", ream=Ream(alignment="greedy"))
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ream:
    """How experts are merged (the option group ``ream`` of the merge job; fields = its options).

    ``similarity_mode``: ``gated`` or ``average`` (:mod:`mlx_fun.rewrite.merge`, step 3); ``alignment``:
    ``hungarian``, ``greedy`` or ``none`` (step 5); ``max_group_size``: most experts per group, centroid included
    (REAM's C); ``max_similarity_tokens``: tokens every expert is run on to measure similarity;
    ``max_alignment_tokens``: the first that many of them align neurons. They are the keyword arguments of the same
    names of :func:`mlx_fun.rewrite.merge.merge_model`."""

    similarity_mode: str = "gated"
    alignment: str = "hungarian"
    max_group_size: int = 16
    max_similarity_tokens: int = 512
    max_alignment_tokens: int = 256


__all__ = ["Ream"]
