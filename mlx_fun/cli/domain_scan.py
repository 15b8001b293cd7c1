"""``mlx-fun domain-scan``: parses, calls :func:`mlx_fun.jobs.domain_scan.run`, prints."""

from __future__ import annotations

import dataclasses

import click

from ..jobs import domain_scan
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options
from .safety_scan import show


@click.command("domain-scan", short_help="Domain vs general routing → domain_report.json (domain / general experts).")
@job_options(domain_scan.run)
@friendly_errors
def command(**kwargs):
    """Find the experts a domain uses more than general text does (and the reverse), with the same differential
    scores as `safety-scan`. `prune --domain-map` protects the domain experts; `serve --domain-map` and `steer`
    boost them (or suppress the general experts).

    \b
    Example (after `python -m scripts.tools.prepare_dataset --output runs/corpus`):
      mlx-fun domain-scan --model data/tiny-moe --domain-dataset runs/corpus/code/train.jsonl \\
          --general-dataset runs/corpus/prose/train.jsonl --domain-name python --output runs/domain_report.json \\
          --max-samples 32 --max-tokens 256 --seed 0
    """
    kwargs = job_kwargs(domain_scan.run, kwargs)
    kwargs["settings"] = dataclasses.replace(kwargs["settings"], progress=True)
    show(domain_scan.run(**kwargs, log=echo_err))


__all__ = ["command", "show"]
