"""Library jobs: one module per ``mlx-fun`` command (``collect``, ``prune``, ``merge``, ``eval``, ``smoke_test``,
``demo``, ``serve``, ``safety_scan``, ``domain_scan``, ``steer``, ``amplify``, ``abliterate``, ``quantize``, ``ui``, ``tune_dispatch``, ``stats_diff``, ``stats_merge``, ``stats_purge``, ``doctor``), each with a typed,
keyword-only ``run(...)`` that does the whole command and returns its result — the way mlx-lm's ``convert.py``
ends in ``convert(**vars(args))``. The CLI (``mlx_fun/cli/<same name>.py``) only parses, calls ``run`` and prints.

    from mlx_fun import jobs
    from mlx_fun.experts.selection import Selection
    jobs.collect.run(model="data/tiny-moe", dataset="data/calibration_sample.jsonl", output="s.npz")
    jobs.prune.run(model="data/tiny-moe", saliency="s.npz", selection=Selection(n_prune=8), output="pruned")

Every ``run`` is decorated where it is defined with :func:`mlx_fun.jobs.common.job`: ``model`` (``reference``,
``draft_model``) may be a Hugging Face repo id (``org/name``, with ``revision=``), resolved once to its snapshot in
the Hugging Face cache as mlx-lm does (a local directory of the same name wins) before anything else runs; an
option group's fields may be given by name (folded into the group); each option is checked against its declared
range, and each input path that must exist does; each output it reserves is refused if it is, contains or lies
inside any path the job reads (every parameter and group field annotated with ``Path``). Option groups
(``settings=RunSettings(...)`` and the others: :func:`mlx_fun.settings.option_groups`) must be instances of their
dataclass, and check their own values when built (:class:`mlx_fun.core.options.Group`).

Errors are one-line ``UserError`` s that name the parameter at fault (``n_prune=`` here, ``--n-prune`` under the
CLI: :func:`mlx_fun.errors.param`).
"""

from __future__ import annotations

import importlib

#: every job, once, in the command order of mlx_fun.cli.COMMANDS; each module is imported the first time it is used
#: (``jobs.prune``, ``from mlx_fun.jobs import prune``), so a command imports its own job only
NAMES = ("collect", "prune", "merge", "eval", "smoke_test", "demo", "serve", "safety_scan", "domain_scan", "steer",
         "amplify", "abliterate", "quantize", "ui", "tune_dispatch", "stats_diff", "stats_merge", "stats_purge",
         "doctor")


def __getattr__(name: str):
    """``jobs.<name>`` (the job module, imported now), ``ALL`` (every job module, in :data:`NAMES` order) and
    ``ANY_MODEL`` (the jobs that take any model mlx-lm loads, dense ones too: ``@job(any_model=True)``; the others
    refuse a repo that is no supported MoE before its weights are downloaded)."""
    if name in NAMES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "ALL":
        return tuple(importlib.import_module(f"{__name__}.{n}") for n in NAMES)
    if name == "ANY_MODEL":
        return tuple(j for j in __getattr__("ALL") if j.run.any_model)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *NAMES, "ALL", "ANY_MODEL"})
