"""Library jobs: one module per ``mlx-fun`` command (``collect``, ``prune``, ``merge``, ``eval``, ``smoke_test``,
``demo``, ``serve``, ``safety_scan``, ``domain_scan``, ``steer``, ``amplify``, ``abliterate``, ``quantize``, ``ui``, ``tune_dispatch``, ``stats_diff``, ``stats_merge``, ``stats_purge``, ``doctor``), each with a typed,
keyword-only ``run(...)`` that does the whole command and returns its result — the way mlx-lm's ``convert.py``
ends in ``convert(**vars(args))``. The CLI (``mlx_fun/cli/<same name>.py``) only parses, calls ``run`` and prints.

    from mlx_fun import jobs
    from mlx_fun.experts.selection import Selection
    jobs.collect.run(model="data/tiny-moe", dataset="data/calibration_sample.jsonl", output="s.npz")
    jobs.prune.run(model="data/tiny-moe", saliency="s.npz", selection=Selection(n_prune=8), output="pruned")

Every ``run`` here is wrapped by :func:`mlx_fun.jobs.common.job_inputs`: each output it reserves is refused if it is,
contains or lies inside any path the job was given to read (every parameter annotated with ``Path``); and, outside
that, by :func:`mlx_fun.model.hub.resolving`: ``model`` (``reference``, ``draft_model``) may be a Hugging Face repo id
(``org/name``, with ``revision=``), resolved once to its snapshot in the Hugging Face cache as mlx-lm does (a
local directory of the same name wins) before anything else runs.

Option groups (``settings=RunSettings(...)`` and the others: :func:`mlx_fun.settings.option_groups`) must be
instances of their dataclass (:func:`mlx_fun.settings.checking_groups` says how to build one otherwise).

Errors are one-line ``UserError`` s that name the parameter at fault (``n_prune=`` here, ``--n-prune`` under the
CLI: :func:`mlx_fun.errors.param`).
"""

from . import (  # noqa: E402,F401 - the jobs, one per command (mlx_fun.cli.COMMANDS)
    abliterate,
    amplify,
    collect,
    demo,
    doctor,
    domain_scan,
    eval,
    merge,
    prune,
    quantize,
    safety_scan,
    serve,
    smoke_test,
    steer,
    stats_diff,
    stats_merge,
    stats_purge,
    tune_dispatch,
    ui,
)

from ..model.hub import resolving as _resolving  # noqa: E402
from ..settings import checking_groups as _checking_groups  # noqa: E402
from .common import job_inputs as _job_inputs  # noqa: E402

#: every job, once: command name order of mlx_fun.cli.COMMANDS
ALL = (collect, prune, merge, eval, smoke_test, demo, serve, safety_scan, domain_scan, steer, amplify, abliterate,
       quantize, ui, tune_dispatch, stats_diff, stats_merge, stats_purge, doctor)
#: jobs that take any model mlx-lm loads (dense ones too); the others refuse a repo that is no supported MoE before
#: its weights are downloaded
ANY_MODEL = (eval, smoke_test, tune_dispatch)
for _job in ALL:
    if not hasattr(_job.run, "reads"):
        _job.run = _resolving(_job_inputs(_checking_groups(_job.run)), needs_moe=_job not in ANY_MODEL)
