"""Console entry point: re-exec once with a fast BLAS preloaded (Linux CPU), keep PyTorch (and, for commands that
never tokenize, transformers) out of the process and mlx-lm's tokenizer code out of every command's start
(:mod:`mlx_fun.runtime.lean_imports`), load a tokenizer without transformers where the ``tokenizers`` library
gives transformers' ids and prompts (:mod:`mlx_fun.model.fast_tokenizer`), then run the click group, which
imports the chosen command's module only.

``env.keep_float32`` (float32 matmuls stay float32: MLX's TF32 default changes REAP's near-ties on a GPU) and
``maybe_reexec`` must run before anything imports ``mlx``, and the import set-up before anything imports
``mlx_lm``, hence the import of the CLI inside ``main``. Both are process-wide, so they happen here, in the console
entry, and not in the click group (which tests and embedders invoke in their own process).
"""

from __future__ import annotations

import sys


def command_name(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option of the group)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main():
    from .core import env
    from .runtime.blas import maybe_reexec

    env.keep_float32()  # before mlx is imported (and carried into the re-exec)
    maybe_reexec()

    from .runtime import cpu_load, lean_imports

    cpu_load.started()  # the window tune-dispatch reads the load over before measuring opens here, not in a sleep
    from .cli import TOKENIZER_FREE

    lean_imports.block_torch()  # no command uses PyTorch; transformers would import it (15-18 s) where installed
    if command_name(sys.argv[1:]) in TOKENIZER_FREE:
        lean_imports.defer_tokenizers()
    else:  # mlx-lm's __init__ (its tokenizer code) waits until the command loads a tokenizer, which needs no
        lean_imports.defer_mlx_lm()  # transformers where the tokenizers library reads it as transformers does
        from .model import fast_tokenizer

        lean_imports.defer_transformers(fast=fast_tokenizer.load,
                                        renderer=fast_tokenizer.FastTokenizer.apply_chat_template)

    from .cli import main as cli_main
    from .cli.common import sparing_stderr

    with sparing_stderr():  # click's own usage errors too: a closed or full stderr never changes the exit status
        cli_main()
