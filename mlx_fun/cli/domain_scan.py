"""``mlx-fun domain-scan``: parses, calls :func:`mlx_fun.jobs.domain_scan.run`, prints."""

from __future__ import annotations

import click

from .common import (
    dispatch_option,
    echo_err,
    friendly_errors,
    model_option,
    run_settings,
    scan_options,
    token_budget_option,
)
from .safety_scan import show


@click.command("domain-scan", short_help="Domain vs general routing → domain_report.json (domain / general experts).")
@model_option
@scan_options(("domain-dataset", "general-dataset"),
              ("Domain text: JSONL or a directory of files.", "General text, same formats."))
@click.option("--domain-name", required=True, help="Name of the domain (e.g. solidity, medical), kept in the report.")
@dispatch_option
@token_budget_option
@friendly_errors
def command(**kwargs):
    """Find the experts a domain uses more than general text does (and the reverse), with the same differential
    scores as `safety-scan`. `prune --domain-map` protects the domain experts; `serve --domain-map` and `steer`
    boost them (or suppress the general experts).

    \b
    Example (after `python -m scripts.tools.prepare_dataset --output corpus`):
      mlx-fun domain-scan --model data/tiny-moe --domain-dataset corpus/code/train.jsonl \\
          --general-dataset corpus/prose/train.jsonl --domain-name python --output domain_report.json \\
          --max-samples 32 --max-tokens 256 --seed 0
    """
    from ..jobs import domain_scan

    settings = run_settings(kwargs)
    show(domain_scan.run(**kwargs, settings=settings, log=echo_err))


__all__ = ["command", "show"]
