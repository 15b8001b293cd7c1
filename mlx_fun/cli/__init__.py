"""The ``mlx-fun`` click group. One module per command; each only parses, calls its job, prints. A run imports the
chosen command's module alone (:class:`_Commands`)."""

from __future__ import annotations

import importlib
from collections.abc import MutableMapping

import click

from .. import __version__


def _show_version(ctx, _param, value) -> None:
    """``--version``: the version and the BLAS line, worked out only when asked for (the BLAS status reads the
    installed distributions: 50-100 ms that no command should pay)."""
    if not value or ctx.resilient_parsing:
        return
    from ..runtime.blas import blas_status

    click.echo(f"mlx-fun {__version__}\n{blas_status()}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version and exit.")
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


class _Commands(MutableMapping):
    """The group's commands by name; a command's module (and so its job's) is imported the first time the command
    is asked for, so a run imports its own command's code, not all nineteen (``--help`` lists them all, and so
    imports them all). Names added with ``add_command`` are kept as they are."""

    def __init__(self):
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            if name not in COMMANDS:
                raise KeyError(name)
            cmd = importlib.import_module(f"{__name__}.{module_name(name)}").command
            assert cmd.name == name, (cmd.name, name)
            self._loaded[name] = cmd
        return self._loaded[name]

    def __setitem__(self, name: str, cmd: click.Command) -> None:
        self._loaded[name] = cmd

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __iter__(self):
        yield from COMMANDS
        yield from (name for name in self._loaded if name not in COMMANDS)

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self._loaded))


main.commands = _Commands()
