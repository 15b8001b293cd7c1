"""Models named by a Hugging Face repo id (``org/name``), resolved the way mlx-lm resolves them, and where outputs
read where a model came from.

mlx-lm's rule (``mlx_lm.utils._download``): a path that exists is a local model directory; anything else is a repo
id, fetched with ``huggingface_hub.snapshot_download`` into the standard Hugging Face cache (``HF_HUB_CACHE``,
``HF_HOME``), only the files matching mlx-lm's ``DEFAULT_ALLOW_PATTERNS``, at ``revision`` (default branch
otherwise), from the cache alone under ``HF_HUB_OFFLINE=1``. mlx-fun follows it with three differences, all
about failing early and in one line:

* only an ``org/name`` string that is a valid repo id is looked up (a ``Path``, an absolute or ``./`` path or a
  bare name that does not exist stays a path: the job says it does not exist);
* ``config.json`` is fetched first and checked (present; for commands that need one, a Mixture-of-Experts type
  mlx-fun supports) before the weights are downloaded, so a dense or non-mlx-lm repo costs one small file;
* ``revision`` must be what the Hub takes, a branch or tag name (git's refname rules: no ``..``, no empty,
  leading or trailing ``/``, ...; ``refs/pr/N`` too) or a commit hash, checked before the cache is looked at
  (huggingface_hub joins it to the cache's ``refs/`` directory as a path);
* every ``huggingface_hub`` failure (no such repo, gated, no such revision, offline and not cached, the Hub
  unreachable, an incomplete cached snapshot: files whose blobs are missing, a ref naming a commit whose snapshot
  is missing) is a :class:`~mlx_fun.errors.UserError` naming the flag, and for an incomplete download, how to
  fetch it again.

:func:`resolving` wraps a job's ``run`` (``mlx_fun.jobs`` wraps every job once): its model-like parameters
(:data:`MODEL_PARAMS`) become local paths before the job body runs, it takes ``revision`` (of ``model``'s repo),
and while the job runs :func:`source` tells metadata writers which repo and commit a resolved path is (and
:func:`display_name` the name to record: the repo id, else the path as given; :func:`short_name`: the repo id, else the
directory's name).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import re
from pathlib import Path
from typing import Callable

from ..core.options import Opt
from ..errors import UserError, param

#: job parameters that name a model: each may be a local directory or a repo id
MODEL_PARAMS = ("model", "reference", "draft_model")
#: ``revision=``, which :func:`resolving` adds to a job with a model (``--revision`` on the command line)
REVISION = Opt("With a repo id in --model: its branch, tag or commit hash  [default: main].", metavar="REV")
#: a snapshot directory of the Hugging Face cache: ``…/models--org--name/snapshots/<commit>``
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")
#: what no branch or tag name holds (git check-ref-format): control characters, space, ``~^:?*[\``, ``..``, ``@{``
_NOT_IN_A_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{")
#: resolved path (absolute, as a string) → its provenance, for the job running now (and the jobs it calls)
_SOURCES: contextvars.ContextVar[dict[str, dict]] = contextvars.ContextVar("mlx_fun_hub_sources", default={})


def allow_patterns() -> list[str]:
    """The files mlx-lm downloads for a model (``mlx_lm.utils.DEFAULT_ALLOW_PATTERNS``)."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS)


def is_repo_id(value) -> bool:
    """``value`` is a string of the form ``org/name`` that the Hub accepts as a repo id (``Path`` objects are
    always paths)."""
    if not isinstance(value, str) or value.count("/") != 1 or value.startswith((".", "/", "~")):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def check_revision(revision) -> None:
    """A one-line ``UserError`` naming ``revision`` unless it is a branch or tag name as git and the Hub take them
    (``main``, ``v1.0``, ``refs/pr/3``) or a commit hash: never a path into the cache."""
    if (not isinstance(revision, str) or revision == "@" or _NOT_IN_A_REF.search(revision) or revision.endswith(".")
            or any(not part or part.startswith(".") or part.endswith(".lock") for part in revision.split("/"))):
        raise UserError(f"{param('revision')} {revision!r} is not a branch, tag or commit hash of a Hugging Face "
                        f"repo; pass a branch or tag name (main, v1.0, refs/pr/3) or a commit hash: no '..', no "
                        f"empty, leading or trailing '/', no part starting with '.' or ending in '.lock', no "
                        f"trailing '.', no space, control character or any of ~ ^ : ? * [ \\ @{{.")


def source(path) -> dict | None:
    """Where the model directory ``path`` came from: ``{"repo_id", "revision", "commit"}`` when the running job
    resolved it from a repo id (``revision``: the one asked for, ``main`` by default), ``{"repo_id", "commit"}``
    for any other snapshot directory of the Hugging Face cache, else ``None`` (a plain local directory)."""
    if path is None:
        return None
    resolved = os.path.realpath(os.fspath(path))
    known = _SOURCES.get().get(resolved)
    if known is not None:
        return dict(known)
    m = _SNAPSHOT.search(resolved.replace(os.sep, "/"))
    return None if m is None else {"repo_id": f"{m['org']}/{m['name']}", "commit": m["commit"]}


def display_name(path) -> str | None:
    """How outputs name the model read from ``path``: its Hugging Face repo id where :func:`source` knows one (a repo
    id the job resolved, a snapshot of the cache), else ``path`` as it was given (None stays None)."""
    if path is None:
        return None
    found = source(path)
    return str(found["repo_id"]) if found and found.get("repo_id") else os.fspath(path)


def short_name(path) -> str:
    """The model at ``path`` named in a few words: its Hugging Face repo id where :func:`source` knows one, else the
    local directory's name (no machine's directories: what a model card or a warning shows)."""
    found = source(path)
    if found and found.get("repo_id"):
        return str(found["repo_id"])
    return Path(os.path.abspath(os.fspath(path))).name


def resolve(value, *, name: str = "model", revision: str | None = None, needs_moe: bool = False,
            log: Callable[[str], None] = lambda _line: None) -> tuple[object, dict | None]:
    """``(local path, provenance)`` for parameter ``name``'s ``value``: a path that exists (or anything that is not
    a repo id) comes back unchanged with ``None``; a repo id is fetched into (or found in) the Hugging Face cache
    and comes back as its snapshot directory with ``{"repo_id", "revision", "commit"}``."""
    if revision is not None:
        check_revision(revision)
    if _exists(value):
        if revision is not None:
            raise UserError(f"{param('revision')} {revision} applies to a Hugging Face repo id, but {param(name)} "
                            f"{value} is a local directory (a local directory wins over a repo id of the same name); "
                            f"drop {param('revision')}, or rename the directory to fetch the repo.")
        return value, None
    if not is_repo_id(value):
        if revision is not None and value is None:
            raise UserError(f"{param('revision')} {revision} needs a Hugging Face repo id in {param(name)}; pass one "
                            f"(org/name) or drop {param('revision')}.")
        return value, None
    if os.environ.get("MLXLM_USE_MODELSCOPE", "false").lower() == "true":
        raise UserError(f"MLXLM_USE_MODELSCOPE is set, but mlx-fun fetches {param(name)} {value} from the Hugging "
                        f"Face Hub only; unset it, or download the model and pass its local directory.")
    flag, asked = param(name), revision or "main"
    unreachable = None if _offline() else _unreachable(value, revision)
    if not _offline() and unreachable is None:
        log(f"{flag} {value}: fetching the Hugging Face repo ({asked}) into its cache, only the files mlx-lm loads ...")
    head = _snapshot(value, revision, ["config.json"], flag, asked, unreachable)
    commit = head.name
    _check_config(head, value, commit, flag, needs_moe)
    path = _snapshot(value, commit, allow_patterns(), flag, asked, unreachable)
    if not any(path.glob("model*.safetensors")):
        raise UserError(f"{flag} {value} (commit {commit[:12]}) has no model*.safetensors weights: it is not an mlx-lm "
                        f"model; pick an MLX conversion of it (e.g. from mlx-community) or convert it with "
                        f"`mlx_lm.convert`.")
    if unreachable is not None:
        log(f"{flag} {value} ({asked}): the Hugging Face Hub cannot be reached ({unreachable}); using the cached "
            f"snapshot {commit[:12]} in {path}")
    else:
        log(f"{flag} {value} ({asked}): snapshot {commit[:12]} in {path}")
    return str(path), {"repo_id": value, "revision": asked, "commit": commit}


def _exists(value) -> bool:
    if not isinstance(value, (str, os.PathLike)):
        return False
    try:
        return Path(value).exists()
    except (OSError, ValueError):  # a name too long, a NUL byte: not an existing path
        return False


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` as ``huggingface_hub`` read it when it was imported (as mlx-lm's download sees it)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


#: the Hub's answers that mean "not now" (huggingface_hub retries on the same statuses)
_NOT_NOW = (408, 429, 500, 502, 503, 504)


def _unreachable(repo_id: str, revision: str | None) -> str | None:
    """Why the Hugging Face Hub gives no answer about ``repo_id`` now (a refused or dropped connection, a name that
    does not resolve, a failing proxy, a timeout, the Hub down or rate-limiting: :data:`_NOT_NOW`), in a few words;
    None where it answers, whatever it answers (``snapshot_download`` then does what it does).

    One request, not retried, within huggingface_hub's ``HF_HUB_ETAG_TIMEOUT`` (10 s by default). Without it, an
    unreachable Hub costs 25-28 s before the cache is used: ``snapshot_download`` given a commit lists the repo's files
    with five retries, printing a line for each; mlx-lm, like this, falls back to the cache at once."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().repo_info(repo_id, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        return f"HTTP {status}" if status in _NOT_NOW else None
    except Exception as e:  # noqa: BLE001 - the HTTP client's own errors (httpx's, httpx2's TransportError)
        if isinstance(e, OSError) or any(c.__name__ == "TransportError" for c in type(e).__mro__):
            return f"{type(e).__name__}: {_brief(e)}"
        return None  # anything else: snapshot_download's own handling, as before this look
    return None


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], flag: str, asked: str,
              unreachable: str | None = None) -> Path:
    """``snapshot_download`` as mlx-lm calls it (from the cache alone when offline, or when the Hub is
    ``unreachable``: why, from :func:`_unreachable`), its failures in one line; ``asked``: the revision the user
    asked for (``revision`` may be its commit by now)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    offline = _offline()
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      local_files_only=offline or unreachable is not None))
    except GatedRepoError:
        raise UserError(f"{flag} {repo_id} is a gated Hugging Face repo and this machine has no access to it: accept "
                        f"its terms on {constants.ENDPOINT}/{repo_id} and log in (`hf auth login`, or set HF_TOKEN)."
                        ) from None
    except RepositoryNotFoundError:
        raise UserError(f"{flag} {repo_id} is neither a local directory nor a Hugging Face repo this machine can see "
                        f"(no such repo, or a private one: log in with `hf auth login` or set HF_TOKEN); check the "
                        f"name.") from None
    except RevisionNotFoundError:
        raise UserError(f"{param('revision')} {asked} does not exist in the Hugging Face repo {repo_id}; pass one of "
                        f"its branches, tags or commits.") from None
    except IncompleteSnapshotError as e:
        missing = re.search(r"\d+ file\(s\) are missing \([^)]*\)", str(e))
        raise UserError(f"the cached snapshot of {flag} {repo_id} ({asked}) is incomplete"
                        f"{f' ({missing.group(0)})' if missing else ''}; {_fetch_again(repo_id, asked, offline)}."
                        ) from None
    except LocalEntryNotFoundError as e:
        why = unreachable or (_brief(e.__cause__) if e.__cause__ else "no connection")
        raise UserError(_not_cached(repo_id, asked, flag, offline, why)) from None
    except HfHubHTTPError as e:
        raise UserError(f"the Hugging Face Hub failed on {flag} {repo_id} ({_brief(e)}); try again later, or pass a "
                        f"local directory.") from None
    missing = _missing_blobs(path, patterns)
    if missing:
        shown = ", ".join(missing[:3]) + (f", ... ({len(missing) - 3} more)" if len(missing) > 3 else "")
        raise UserError(f"the download of {flag} {repo_id} ({asked}, commit {path.name[:12]}) in the Hugging Face "
                        f"cache is incomplete: {len(missing)} file(s) of its snapshot have no data in the cache "
                        f"({shown}: their blobs are missing); {_fetch_again(repo_id, asked, offline)}.")
    return path


def _missing_blobs(snapshot: Path, patterns: list[str]) -> list[str]:
    """The files of a cached snapshot matching ``patterns`` whose link points at no blob (an interrupted download,
    blobs deleted by hand), as repo paths."""
    from huggingface_hub.utils import filter_repo_objects

    names = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_symlink() or p.is_file()]
    return sorted(n for n in filter_repo_objects(names, allow_patterns=patterns) if not (snapshot / n).exists())


def _fetch_again(repo_id: str, asked: str, offline: bool) -> str:
    """How to complete an incomplete download of ``repo_id`` at ``asked``."""
    fetch = f"`hf download {repo_id} --revision {asked}`"
    return (f"run again with HF_HUB_OFFLINE unset (mlx-fun downloads what is missing), or fetch it with {fetch}"
            if offline else f"fetch it again with {fetch}")


def _not_cached(repo_id: str, asked: str, flag: str, offline: bool, reason: str) -> str:
    """Why a repo is not usable from the cache: the repo is not there at all, or not at this revision (``reason``:
    why the Hub could not be asked, where it was not offline)."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE)
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    why = "HF_HUB_OFFLINE is set" if offline else f"the Hugging Face Hub could not be reached ({reason})"
    fix = "unset HF_HUB_OFFLINE to download it" if offline else "check the network"
    commit = _cached_ref(storage / "refs" / asked)
    if commit is not None:  # the ref is cached, its snapshot is not: the download stopped between the two
        return (f"{param('revision')} {asked} of {flag} {repo_id} names commit {commit!r} in the Hugging Face cache "
                f"{cache} (refs/{asked}), but the cache holds no snapshot of that commit: an incomplete download; "
                f"{_fetch_again(repo_id, asked, offline) if offline else f'{fix}, then run again'}.")
    if (storage / "snapshots").is_dir():
        refs = sorted(p.name for p in (storage / "refs").iterdir()) if (storage / "refs").is_dir() else []
        cached = refs + sorted(p.name[:12] for p in (storage / "snapshots").iterdir())
        return (f"{param('revision')} {asked} of {flag} {repo_id} is not in the Hugging Face cache {cache} and {why} "
                f"(cached: {', '.join(cached) or 'nothing'}); {fix}, or pass a cached revision.")
    return (f"{flag} {repo_id} is not a local directory, nor in the Hugging Face cache {cache}, and {why}; {fix}, "
            f"or pass a local mlx-lm model directory.")


def _cached_ref(ref: Path) -> str | None:
    """The commit a cached ref file names (as one short line), or None where there is none to read."""
    try:
        return " ".join(ref.read_text(encoding="utf-8", errors="replace").split())[:40] if ref.is_file() else None
    except OSError:
        return None


def _brief(exc) -> str:
    return " ".join(str(exc).split())[:200]


def _check_config(snapshot: Path, repo_id: str, commit: str, flag: str, needs_moe: bool) -> None:
    """The repo is an mlx-lm model (it has a config.json) and, for commands that need one, an MoE mlx-fun supports:
    checked before the weights are downloaded."""
    from ..adapters import adapter_class

    where = f"{flag} {repo_id} (commit {commit[:12]})"
    cfg = snapshot / "config.json"
    if not cfg.is_file():
        raise UserError(f"{where} has no config.json: it is not an mlx-lm model; pick an MLX conversion of it "
                        f"(e.g. from mlx-community) or convert it with `mlx_lm.convert`.")
    if not needs_moe:
        return
    from ..core import json_input

    try:
        config = json_input.read(cfg, allow_nan=True, error=ValueError)
    except ValueError:
        return  # the job's own config check says what is wrong with it, naming the file
    if not isinstance(config, dict):
        return
    try:
        adapter_class(config)
    except UserError as e:
        if not _names_experts(config):
            raise UserError(f"{where} is a dense {config.get('model_type', 'unknown')} model (its config.json names no "
                            f"experts), not a Mixture-of-Experts model; pass an MoE of a type mlx-fun supports ("
                            f"\"Supported architectures\", docs/guide/architectures.md, lists them).") from None
        raise UserError(f"{where}: {e}") from None


def _names_experts(config: dict) -> bool:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return any("expert" in str(key).lower() for key in (*config, *text))


def resolving(run: Callable, *, needs_moe: bool = True) -> Callable:
    """Wrap a job's ``run``: its :data:`MODEL_PARAMS` are resolved (:func:`resolve`) before the body runs, it
    takes ``revision=`` (of ``model``'s repo), and :func:`source` knows the resolved paths while it runs. A job
    with no model parameter is returned as it is."""
    signature = inspect.signature(run)
    names = [n for n in MODEL_PARAMS if n in signature.parameters]
    if not names:
        return run

    @functools.wraps(run)
    def wrapped(*, revision: str | None = None, **kwargs):
        log = kwargs.get("log") or (lambda _line: None)
        found = {}
        for name in names:
            rev = revision if name == "model" else None
            path, origin = resolve(kwargs.get(name), name=name, revision=rev, needs_moe=needs_moe and name == "model",
                                   log=log)
            if origin is not None:
                kwargs[name] = path
                found[os.path.realpath(path)] = origin
        token = _SOURCES.set({**_SOURCES.get(), **found})
        try:
            return run(**kwargs)
        finally:
            _SOURCES.reset(token)

    params = list(signature.parameters.values())
    at = [p.name for p in params].index(names[0]) + 1
    params.insert(at, inspect.Parameter("revision", inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation="str | None"))
    wrapped.__signature__ = signature.replace(parameters=params)
    return wrapped
