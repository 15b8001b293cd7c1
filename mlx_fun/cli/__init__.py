"""The ``mlx-fun`` click group. One module per command; each only parses, calls its job, prints."""

from __future__ import annotations

import click

from .. import __version__


def _version_message() -> str:
    from ..runtime.blas import blas_status

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


#: every command, explicitly. Command ``x-y`` is parsed and printed by ``mlx_fun/cli/x_y.py`` (``command``,
#: ``show``) and done by the job ``mlx_fun/jobs/x_y.py`` (``run``): one name, three places, one hop.
COMMANDS = ("collect", "prune", "merge", "eval", "smoke-test", "demo", "serve", "safety-scan", "domain-scan",
            "steer", "amplify", "abliterate", "quantize", "ui", "tune-dispatch", "stats-diff", "stats-merge", "stats-purge",
            "doctor")


#: commands that never tokenize: the console entry (mlx_fun.launcher) never imports mlx-lm's tokenizer module (and
#: so transformers) for them
#: (doctor is not one of them: it checks the names mlx-fun uses in mlx-lm's generate module, which imports transformers)
TOKENIZER_FREE = ("prune", "quantize", "amplify", "tune-dispatch", "stats-diff", "stats-merge", "stats-purge")


def module_name(command: str) -> str:
    return command.replace("-", "_")


def _register_commands() -> None:
    import importlib

    for name in COMMANDS:
        cmd = importlib.import_module(f"{__name__}.{module_name(name)}").command
        assert cmd.name == name, (cmd.name, name)
        main.add_command(cmd)


_register_commands()
