"""How calibration samples are drawn and batched: the :class:`Calibration` option group of every job that runs
data through a model (collect, eval, merge, abliterate, safety-scan, domain-scan); its fields are their
``--max-samples``, ``--max-tokens``, ``--text-key``, ``--seed`` and ``--batch-size``. A job's own defaults are its
default instance (``calibration: Calibration = Calibration(batch_size=4)``)."""

from __future__ import annotations

from dataclasses import dataclass

import click

from ..core.options import Group, option
from ..core.ranges import SEED
from .samples import DEFAULT_TEXT_KEY


@dataclass(frozen=True)
class Calibration(Group):
    """``max_samples``: samples used (a random subset, by ``seed``, when the dataset has more); ``max_tokens``: each
    truncated to this many tokens; ``text_key``: the JSON key of plain-text JSONL lines; ``batch_size``: samples per
    forward (length-bucketed; padding never counts)."""

    max_samples: int = option(128, "Use at most this many samples (a random subset when the dataset has more).",
                              type=click.IntRange(min=1))
    max_tokens: int = option(2048, "Truncate every sample to this many tokens.", type=click.IntRange(min=1))
    text_key: str = option(DEFAULT_TEXT_KEY, "JSON key of plain-text JSONL lines.")
    seed: int | None = option(None, "Seed for the random subset of samples.", type=SEED)
    batch_size: int = option(1, "Samples per forward pass (length-bucketed, padding excluded).",
                             type=click.IntRange(min=1))

    def load(self, dataset, tokenizer, *, seed: int | None = None, **kw):
        """The samples of ``dataset`` under this calibration (:func:`mlx_fun.datasets.samples.load_samples`);
        ``seed``: another seed for this call (a shared one under mlx.launch)."""
        from .samples import load_samples

        return load_samples(dataset, tokenizer, max_samples=self.max_samples, max_tokens=self.max_tokens,
                            text_key=self.text_key, seed=self.seed if seed is None else seed, **kw)


__all__ = ["Calibration"]
