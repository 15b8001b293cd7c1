"""Console entry point: re-exec once with a fast BLAS preloaded (Linux CPU), then run the click group.

``maybe_reexec`` must run before anything imports ``mlx``, hence the import of the CLI inside ``main``.
"""

from __future__ import annotations


def main():
    from .blas import maybe_reexec

    maybe_reexec()

    from .cli import main as cli_main

    cli_main()
