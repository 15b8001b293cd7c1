"""The ``mlx-fun`` click group. One module per command family; each only parses, calls the library, prints."""

from __future__ import annotations

import click

from .. import __version__


def _version_message() -> str:
    from ..blas import blas_status

    return f"mlx-fun {__version__}\n{blas_status()}"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "--version", message=_version_message())
def main():
    """mlx-fun: compress, analyse and steer Mixture-of-Experts models with MLX.

    Typical pipeline: collect → prune (or merge) → smoke-test / eval.
    """


from . import collect as _collect  # noqa: E402
from . import doctor as _doctor  # noqa: E402
from . import generate as _generate  # noqa: E402
from . import prune as _prune  # noqa: E402
from . import stats as _stats  # noqa: E402

for _cmd in (*_collect.COMMANDS, *_prune.COMMANDS, *_generate.COMMANDS, *_stats.COMMANDS, *_doctor.COMMANDS):
    main.add_command(_cmd)
