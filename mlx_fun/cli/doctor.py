"""``mlx-fun doctor``: calls :func:`mlx_fun.jobs.doctor.run`, prints."""

from __future__ import annotations

import click

from ..jobs import doctor
from .common import friendly_errors
from .options import job_kwargs, job_options


@click.command("doctor", short_help="MLX backend, device, BLAS in use, versions, matmul speed, model types served.")
@job_options(doctor.run)
@friendly_errors
def command(**kwargs):
    """Show the MLX backend, device, BLAS and versions (mlx and mlx-lm against the tested ranges, and whether this
    mlx-lm has every private mlx-lm name used here), measure a float32 matmul, and count the model types served
    (naming any MoE type of the installed mlx-lm that has no adapter yet); with --model, how each expert shape of
    that model is dispatched here (the table entry the model commands' "experts:" line sums up). Exits 1 when MLX
    cannot be imported or mlx-lm lacks a name a feature needs.

    \b
    Example:
      mlx-fun doctor
    """
    facts = doctor.run(**job_kwargs(doctor.run, kwargs))
    show(facts)
    if facts["mlx"].startswith("cannot import") or facts.get("mlx-lm compat", "").startswith("MISSING"):
        raise SystemExit(1)


def show(facts: dict) -> None:
    for name, text in facts.items():
        # blas_status() already reads "blas: ..."
        click.echo(text if name == "blas" else f"{name}: {text}")
