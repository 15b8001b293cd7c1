"""How a job runs its model, in one typed object: :class:`RunSettings`.

Every job that runs forwards takes ``settings: RunSettings`` (the CLI builds it once from ``--dispatch``,
``--dispatch-table``, ``--dequant-cache``, ``--token-budget``, generated from its fields, and its progress bar),
so a job's own signature holds only what the job is about::

    from mlx_fun import jobs
    from mlx_fun.settings import RunSettings
    jobs.collect.run(model="data/tiny-moe", dataset="data/calibration_sample.jsonl", output="s.npz",
                     settings=RunSettings(token_budget=4096, progress=True))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from .core.options import Group, option
from .errors import UserError, param

#: the expert dispatch modes (:data:`mlx_fun.dispatch.experts.MODES`, named here so the CLI's choices need no MLX)
DISPATCH_MODES = ("auto", "mlx-lm")


@dataclass(frozen=True)
class RunSettings(Group):
    """``dispatch``: ``auto`` (mlx-fun's runtime expert dispatch from measured cut-offs) or ``mlx-lm`` (its fixed
    rule); ``dispatch_table``: an extra cut-off table (JSON from ``tune-dispatch``); ``dequant_cache``: bytes (or
    ``"4GiB"``) of dequantized experts kept where the table says it pays; ``token_budget``: most tokens (rows ×
    columns) per forward (default :data:`mlx_fun.model.engine.DEFAULT_TOKEN_BUDGET`); ``progress``: show progress bars."""

    dispatch: str = option(
        "auto", "MoE expert dispatch: auto picks sorted/unsorted/blocked/dequantized per token count from measured "
        "per-backend cut-offs (and splits calls a backend cannot launch); mlx-lm keeps mlx-lm's fixed rule.",
        type=click.Choice(DISPATCH_MODES))
    dispatch_table: str | Path | None = option(
        None, "Extra cut-off table (JSON from `mlx-fun tune-dispatch`) over the shipped and user tables.",
        type=click.Path(dir_okay=False), missing="pass a JSON table written by `mlx-fun tune-dispatch`")
    dequant_cache: int | str = option(
        "0", "With --dispatch auto: memory allowed for keeping dequantized experts of quantized layers (e.g. 4GiB; "
        "K/M/G are powers of 1024), used where the table says it is faster. 0 = off.", type=click.STRING,
        metavar="SIZE")
    token_budget: int | None = option(
        None, "Most tokens (rows × columns) per forward pass: larger batches are split and longer samples fed in "
        "chunks with the KV cache, so no batch size or length can exhaust memory.", type=click.IntRange(min=1),
        metavar="N", default_text="8192")
    progress: bool = False

    def validate(self) -> None:
        self.dequant_bytes()

    def check(self) -> "RunSettings":
        """The checks that read the disk (the table exists), before anything loads; returns ``self``. The rest
        was checked when the settings were built (:class:`mlx_fun.core.options.Group`)."""
        self.check_paths()
        return self

    def dequant_bytes(self) -> int:
        from .core.sizes import parse_bytes

        try:
            return parse_bytes(self.dequant_cache)
        except ValueError as e:
            raise UserError(f"{param('dequant_cache')}: {e}") from None

    def apply(self, model, log=None):
        """Install the dispatch on ``model`` (``auto``) or keep mlx-lm's; returns the
        :class:`mlx_fun.dispatch.experts.DispatchReport` (its line in words, ``brief``, goes to ``log``, and, the first
        time on a machine whose backend has no measured entry, a line suggesting ``tune-dispatch``; the full line of
        table entries is ``mlx-fun doctor --model``'s). A bad table is a one-line
        ``UserError`` naming the file, the problem and the fix (:func:`mlx_fun.dispatch.experts.load_table`)."""
        from .dispatch import experts as dispatch
        from .dispatch.table import untuned_notice

        table = None if self.dispatch_table is None else str(self.dispatch_table)
        try:
            report = dispatch.apply(model, self.dispatch, table, self.dequant_bytes())
        except ValueError as e:
            raise UserError(str(e)) from None
        if log is not None:
            log(report.brief())
            untuned = report.mode == "auto" and report.entries and all(
                how == "default" for _entry, how in report.entries.values())
            if untuned and (line := untuned_notice(report.backend)):
                log(line)  # once per machine: this backend has no measured table entry
        return report

    def budget(self, config: dict, *, dispatch_mode: str, top_k: int | None = None) -> int:
        """Tokens per forward for the engine: ``token_budget`` (default
        :data:`mlx_fun.model.engine.DEFAULT_TOKEN_BUDGET`), lowered under mlx-lm's own expert call where the backend caps
        a grouped matmul's rows (CUDA: 65,535 routed rows, :data:`mlx_fun.dispatch.experts.MAX_ROWS`); mlx-fun's dispatch
        splits such calls itself. ``top_k``: the loaded adapter's (else read from ``config``)."""
        from .model import engine
        from .adapters import adapter_class

        try:
            top_k = top_k or adapter_class(config).config_top_k(config)
        except (UserError, KeyError, TypeError, ValueError):  # a dense or unknown model: the widest usual top-k
            top_k = int(config.get("num_experts_per_tok") or 8)
        try:
            return engine.budget_for(self.token_budget, top_k=top_k, dispatched=dispatch_mode == "auto")
        except UserError as e:
            raise UserError(f"{param('token_budget')}: {e}") from None

    def prefill_step(self, config: dict, *, dispatch_mode: str, top_k: int | None = None) -> int | None:
        """mlx-lm's ``prefill_step_size`` for a generation (smoke-test, steer): :meth:`budget` when
        ``token_budget`` is given, so no prompt forward holds more tokens; None (mlx-lm's own step) without one.
        Decoding feeds one token a forward (speculative decoding: ``num_draft_tokens`` + 1)."""
        if self.token_budget is None:
            return None
        return self.budget(config, dispatch_mode=dispatch_mode, top_k=top_k)


def option_groups(func) -> dict[str, type]:
    """The parameters of ``func`` that group options (those whose default is a dataclass instance, like
    ``settings: RunSettings = RunSettings()``), by name, with their dataclass: a field of one is an option of the
    job as much as a plain parameter is (the CLI builds the group; :func:`mlx_fun.jobs.common.path_params` reads it)."""
    import dataclasses
    import inspect

    return {name: type(p.default) for name, p in inspect.signature(func).parameters.items()
            if dataclasses.is_dataclass(p.default) and not isinstance(p.default, type)}


def grouped(run, kwargs: dict) -> dict:
    """``kwargs`` given by option name (as on the command line) with the fields of ``run``'s option groups
    (:func:`option_groups`: ``selection``, ``settings``, ...) folded into those groups — over the group given, else
    the job's default instance, so its own defaults stay; the rest as they are."""
    import dataclasses
    import inspect

    out = dict(kwargs)
    for name, group in option_groups(run).items():
        names = {f.name for f in dataclasses.fields(group)}
        if names & set(out):
            given = out.get(name)
            base = given if isinstance(given, group) else inspect.signature(run).parameters[name].default
            out[name] = dataclasses.replace(base, **{k: out.pop(k) for k in list(out) if k in names})
    return out


def checking_groups(run):
    """Wrap a job's ``run`` so that each option group it is given is an instance of its dataclass: anything else
    (a dict, a string) is a one-line ``UserError`` saying how to build it, not an AttributeError deep inside."""
    import functools

    groups = option_groups(run)
    if not groups:
        return run

    @functools.wraps(run)
    def wrapped(*args, **kwargs):
        for name, cls in groups.items():
            value = kwargs.get(name)
            if value is not None and not isinstance(value, cls):
                raise UserError(f"{param(name)} must be a {cls.__name__} (from {cls.__module__} import "
                                f"{cls.__name__}; {name}={cls.__name__}(...)), got {type(value).__name__}.")
        return run(*args, **kwargs)

    return wrapped


__all__ = ["RunSettings", "checking_groups", "grouped", "option_groups"]
