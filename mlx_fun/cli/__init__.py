"""The ``mlx-fun`` click group. One module per command family; each only parses, calls the library, prints."""

from __future__ import annotations

import click

from .. import __version__


def _version_message() -> str:
    from ..blas import blas_status

    return f"mlx-fun {__version__}\n{blas_status()}"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "--version", message=_version_message())
@click.option("--debug", is_flag=True, help="Show the full traceback of unexpected errors (also MLX_FUN_DEBUG=1).")
@click.pass_context
def main(ctx, debug):
    """mlx-fun: compress, analyse and steer Mixture-of-Experts models with MLX.

    Typical pipeline: collect → prune (or merge) → smoke-test / eval.
    """
    ctx.obj = {"debug": debug}


def _register_commands() -> None:
    """Add every ``COMMANDS`` list found in this package's modules (one module per command family)."""
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for cmd in getattr(module, "COMMANDS", ()):
            main.add_command(cmd)


_register_commands()
