"""Console entry point (placeholder: the fast-BLAS re-exec is being written)."""


def main():
    from .cli import main as cli_main

    cli_main()
