"""``mlx-fun doctor``: calls :func:`mlx_fun.jobs.doctor.run`, prints."""

from __future__ import annotations

import click


@click.command("doctor", short_help="MLX backend, device, BLAS in use, versions, matmul speed, model types served.")
def command():
    """Show the MLX backend, device, BLAS and versions, measure a float32 matmul, and count the model types served
    (naming any MoE type of the installed mlx-lm that has no adapter yet).

    \b
    Example:
      mlx-fun doctor
    """
    from ..jobs import doctor

    facts = doctor.run()
    show(facts)
    if facts["mlx"].startswith("cannot import"):
        raise SystemExit(1)


def show(facts: dict) -> None:
    for name, text in facts.items():
        # blas_status() already reads "blas: ..."
        click.echo(text if name == "blas" else f"{name}: {text}")
