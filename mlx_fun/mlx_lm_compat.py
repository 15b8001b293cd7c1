"""The mlx-lm versions mlx-fun is tested with, and every private (underscore or model-file internal) mlx-lm name it
uses, in one table.

mlx-fun reaches into mlx-lm where no public API exists: the sorted expert path of ``switch_layers``, the model
files' own compiled routing functions, ``utils._get_classes``, the server's and generator's internals. A newer
mlx-lm may drop or rename any of them. Each is listed in :data:`TABLE` with the features that need it, and every
use goes through this module (:func:`get`, :func:`lookup`, :func:`model_function`, :func:`member`), or the feature
calls :func:`require` at its entry: a missing name is then one line (:class:`~mlx_fun.errors.UserError`) naming
it, the feature and the tested range, never an ``AttributeError`` deep in a run. ``mlx-fun doctor`` prints
:func:`report`; ``tests/test_compat.py`` fails when ``mlx_fun/`` uses a private mlx-lm name this table lacks, or
when the installed mlx-lm lacks one of the table's names.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

#: the mlx-lm releases the suite runs against (pyproject.toml pins the same range; a test keeps them equal)
MLX_LM_LOWER, MLX_LM_UPPER = "0.32.2", "0.33"
MLX_LM_RANGE = f">={MLX_LM_LOWER},<{MLX_LM_UPPER}"
#: the MLX the project needs (pyproject.toml's ``mlx`` / ``mlx[cpu]`` lower bound; MLX itself has no upper one)
MLX_RANGE = ">=0.32.2"

#: what needs the names (the keys of a row's ``features``), as the error line names it
FEATURES = {
    "dispatch": "mlx-fun's expert dispatch (--dispatch auto / mlx-fun)",
    "tiny models": "the tiny models (demo, tests, mlx_fun.testing.tiny)",
    "smoke-test": "smoke-test's model check",
    "config check": "the config check before loading",
    "eval": "eval's tokenizer check",
    "serve": "mlx-fun serve",
}
ROUTING = " routing"


@dataclass(frozen=True)
class Private:
    """``module.name`` (``name`` may be ``Class.attribute``: a method, or an attribute its ``__init__`` sets)."""

    module: str
    name: str
    #: features (keys of FEATURES, or ``"<model_type> routing"``) that cannot run without it
    features: tuple[str, ...]
    #: features that use it when present and work around it otherwise
    fallback: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"


def _routing(module: str, name: str, *model_types: str) -> Private:
    return Private(f"mlx_lm.models.{module}", name, tuple(t + ROUTING for t in model_types))


_SERVER = "mlx_lm.server"
#: every private mlx-lm name used anywhere in mlx_fun/ (tests/test_compat.py scans the sources against it)
TABLE: tuple[Private, ...] = (
    Private("mlx_lm.models.switch_layers", "_gather_sort", ("dispatch",)),
    Private("mlx_lm.models.switch_layers", "_scatter_unsort", ("dispatch",)),
    # confirms what model_classes finds no model file for (a newer mlx-lm's own rule, or a type it lacks)
    Private("mlx_lm.utils", "_get_classes", (), fallback=("tiny models", "smoke-test", "config check")),
    Private("mlx_lm.tokenizer_utils", "TokenizerWrapper._tokenizer", (), fallback=("eval",)),
    # the adapters' routing: each model file's own selection function (adapters.base.model_function)
    _routing("deepseek_v3", "group_expert_select", "deepseek_v3", "kimi_k2", "kimi_k25", "kimi_vl"),
    _routing("deepseek_v32", "group_expert_select", "deepseek_v32", "glm_moe_dsa"),
    _routing("dots1", "group_expert_select", "dots1"),
    _routing("glm4_moe", "group_expert_select", "glm4_moe", "solar_open"),
    _routing("glm4_moe_lite", "group_expert_select", "glm4_moe_lite"),
    _routing("exaone_moe", "group_expert_select", "exaone_moe"),
    _routing("mimo_v2_flash", "group_expert_select", "mimo_v2_flash"),
    _routing("nemotron_h", "group_expert_select", "nemotron_h"),
    _routing("bailing_moe", "group_expert_select", "bailing_moe"),
    _routing("bailing_moe", "aggregate_expert_outputs", "bailing_moe"),
    _routing("bailing_moe_linear", "group_expert_select", "bailing_moe_linear"),
    _routing("bailing_moe_v3", "_group_expert_select", "bailing_moe_v3", "bailing_hybrid"),
    _routing("kimi_linear", "_group_expert_select", "kimi_linear"),
    _routing("kimi_k3", "_group_expert_select", "kimi_k3"),
    _routing("mistral4", "mistral4_expert_select", "mistral4", "mistral3"),
    _routing("step3p5", "moe_gate_select", "step3p5"),
    _routing("phimoe", "sparsemixer", "phimoe"),
    _routing("gemma4_text", "Router._root_size", "gemma4", "gemma4_text"),
    _routing("laguna", "MoEGate._routing_scores", "laguna"),
    # mlx-fun serve: subclasses of mlx-lm's server classes, and the padding probe (which serve can do without)
    Private("mlx_lm.generate", "_right_pad_prompts", (), fallback=("serve",)),
    Private(_SERVER, "ModelProvider._model_map", ("serve",)),
    Private(_SERVER, "ModelProvider._adapter_map", ("serve",)),
    Private(_SERVER, "ModelProvider._load", ("serve",)),
    Private(_SERVER, "ResponseGenerator._next_request", ("serve",)),
    Private(_SERVER, "ResponseGenerator._run_generate", ("serve",)),
    Private(_SERVER, "ResponseGenerator._stop", ("serve",)),
    Private(_SERVER, "ResponseGenerator._tokenize", ("serve",)),
    Private(_SERVER, "ResponseGenerator._generation_thread", ("serve",)),
    Private(_SERVER, "APIHandler._set_cors_headers", ("serve",)),
)
_ROWS = {(row.module, row.name): row for row in TABLE}


def routing_feature(model_type: str) -> str:
    """The feature key of an adapter's routing (its model type's rows; none for most types)."""
    return model_type + ROUTING


def describe(feature: str) -> str:
    if feature.endswith(ROUTING):
        return f"the {feature[: -len(ROUTING)]} adapter's routing"
    return FEATURES[feature]


# ------------------------------------------------------------------------------------------ versions
def installed(dist: str) -> str | None:
    """The installed version of ``dist`` (MLX built from source has no distribution metadata: its own), or None."""
    from importlib import metadata  # here: reading the installed distributions' index costs 20-60 ms at a start

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    try:
        return importlib.import_module(dist.replace("-", "_")).__version__
    except Exception:  # noqa: BLE001 - not importable either
        return None


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (``0.33.0rc1`` → ``(0, 33, 0)``)."""
    m = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def in_tested_range(version: str) -> bool:
    v = _release(version)
    return _release(MLX_LM_LOWER) <= v < _release(MLX_LM_UPPER)


def _fix() -> str:
    return f"mlx-fun is tested with mlx-lm {MLX_LM_RANGE}: pip install 'mlx-lm{MLX_LM_RANGE}'"


# ------------------------------------------------------------------------------------------ presence
def _assigned_in(cls: type, attr: str) -> bool:
    """Whether ``cls``'s source sets ``self.<attr>`` (an instance attribute its ``__init__`` creates)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(attr)}\s*(:[^=\n]*)?=", source) is not None


def _resolve(row: Private):
    """The object ``row`` names (a class for an instance attribute), or None where this mlx-lm lacks it."""
    try:
        obj = importlib.import_module(row.module)
    except Exception:  # noqa: BLE001 - a module that is gone or fails to import lacks the name as well
        return None
    parts = row.name.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif i == len(parts) - 1 and isinstance(obj, type) and _assigned_in(obj, part):
            return obj
        else:
            return None
    return obj


def present(row: Private) -> bool:
    return _resolve(row) is not None


def _row(module: str, name: str) -> Private:
    try:
        return _ROWS[(module, name)]
    except KeyError:
        raise LookupError(f"{module}.{name} is not in mlx_fun.mlx_lm_compat.TABLE; add it there") from None


def missing_error(row: Private, feature: str | None = None) -> UserError:
    """The one line for a name this mlx-lm lacks: the name, what needs it, the tested range and the fix."""
    needs = describe(feature) if feature else " / ".join(describe(f) for f in row.features + row.fallback)
    return UserError(f"mlx-lm {installed('mlx-lm') or '(not installed)'} lacks {row.path}, needed by {needs}; "
                     f"{_fix()}")


def _check_feature(feature: str) -> None:
    if feature not in FEATURES and not feature.endswith(ROUTING):
        raise LookupError(f"unknown feature {feature!r}: one of {', '.join(FEATURES)} or '<model_type> routing'")


def require(feature: str) -> None:
    """At a feature's entry: a one-line ``UserError`` for the first name it needs that this mlx-lm lacks."""
    _check_feature(feature)
    for row in TABLE:
        if feature in row.features and not present(row):
            raise missing_error(row, feature)


def get(feature: str, module: str, name: str):
    """mlx-lm's private ``module.name`` for ``feature``, or the one-line ``UserError`` where it is gone."""
    _check_feature(feature)
    row = _row(module, name)
    value = _resolve(row)
    if value is None:
        raise missing_error(row, feature)
    return value


def lookup(module: str, name: str):
    """``module.name`` where this mlx-lm has it, else None (for a use that works around its absence)."""
    return _resolve(_row(module, name))


# ------------------------------------------------------------------------------------------ model files
def function_owner(module, name: str) -> tuple[str, str]:
    """``(mlx-lm module, name)``: the model file whose ``name`` :func:`model_function` takes for ``module``."""
    mro = type(module).__mro__
    for cls in mro:
        if getattr(sys.modules.get(cls.__module__), name, None) is not None:
            return cls.__module__, name
    return next((c.__module__ for c in mro if c.__module__.startswith("mlx_lm.")), type(module).__module__), name


def model_function(module, name: str):
    """The function ``name`` of the mlx-lm model file that defines ``module``'s class (its own compiled selection
    function, say), walking the MRO, since a hooked module's class is a subclass defined in ``mlx_fun``."""
    for cls in type(module).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), name, None)
        if fn is not None:
            return fn
    raise _missing_at_run_time(*function_owner(module, name))


def member_owner(obj, name: str) -> tuple[str, str]:
    """``(mlx-lm module, "Class.name")`` of an mlx-lm object's private member (the class that defines it, or the
    object's first mlx-lm class for an attribute its ``__init__`` sets)."""
    classes = [c for c in type(obj).__mro__ if c.__module__.startswith("mlx_lm.")] or [type(obj)]
    cls = next((c for c in classes if name in vars(c)), classes[0])
    return cls.__module__, f"{cls.__name__}.{name}"


def member(obj, name: str):
    """``obj.<name>``, a private member of an mlx-lm object, or the one-line ``UserError`` where it is gone."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise _missing_at_run_time(*member_owner(obj, name))
    return value


_MISSING = object()


def _missing_at_run_time(module: str, name: str) -> Exception:
    row = _ROWS.get((module, name))
    if row is None:
        return LookupError(f"{module}.{name} is not in mlx_fun.mlx_lm_compat.TABLE; add it there")
    return missing_error(row)


# ------------------------------------------------------------------------------------------ model classes
#: mlx-lm's tables of the model types built by another type's file (``mlx_lm.utils``): by type, by (type, architecture)
REMAPPING = ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING")


@functools.cache
def remapping() -> tuple[dict, dict]:
    """mlx-lm's :data:`REMAPPING` tables: from ``mlx_lm.utils`` where it is imported, else read from its file as the
    literals they are (importing it costs huggingface_hub and mlx-lm's tokenizer code, transformers: 0.5-2.4 s before
    a command starts), else (a file that no longer holds them so) imported."""
    if "mlx_lm.utils" not in sys.modules:
        read = _read_remapping()
        if read is not None:
            return read
    utils = importlib.import_module("mlx_lm.utils")
    return tuple(dict(getattr(utils, name, {})) for name in REMAPPING)


def _read_remapping() -> tuple[dict, dict] | None:
    """The tables as ``mlx_lm/utils.py`` writes them (``NAME = {...}`` at the start of a line, a literal), or None."""
    spec = importlib.util.find_spec("mlx_lm")  # the package's location only: nothing of it runs
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        source = (Path(next(iter(spec.submodule_search_locations))) / "utils.py").read_text(encoding="utf-8")
        tables = []
        for name in REMAPPING:
            m = re.search(rf"^{name}\s*=\s*(\{{.*?^\}})", source, re.M | re.S)
            table = ast.literal_eval(m.group(1)) if m else None
            if not isinstance(table, dict):
                return None
            tables.append(table)
    except (OSError, ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return tables[0], tables[1]


def model_module(config: dict) -> str:
    """The mlx-lm model file that builds ``config`` (``mlx_lm.models.<type>``), chosen by ``_get_classes``' rule: an
    architecture remapped for its type first, then the type's remapping, then the type itself."""
    by_type, by_architecture = remapping()
    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    for architecture in architectures:
        remapped = by_architecture.get((model_type, architecture))
        if remapped is not None:
            return f"mlx_lm.models.{remapped}"
    return f"mlx_lm.models.{by_type.get(model_type, model_type)}"


def model_classes(config: dict) -> tuple[type, type]:
    """``(Model, ModelArgs)`` of ``config``'s model type, as ``mlx_lm.utils._get_classes`` finds them, importing only
    the model file (:func:`model_module`): nothing of mlx-lm's loading or tokenizer code. Where that file does not
    import or lacks the classes, ``_get_classes`` itself answers (a newer mlx-lm's rule), and its ``ValueError``
    says that mlx-lm does not support the type."""
    try:
        module = importlib.import_module(model_module(config))
        return module.Model, module.ModelArgs
    except (ImportError, ValueError, AttributeError):
        pass
    _get_classes = lookup("mlx_lm.utils", "_get_classes")
    if _get_classes is None:
        raise ValueError(f"Model type {config['model_type']} not supported.")
    return _get_classes(config)


# ------------------------------------------------------------------------------------------ doctor
def missing() -> list[Private]:
    """The table's names this mlx-lm lacks."""
    return [row for row in TABLE if not present(row)]


def version_line(dist: str, wanted: str, tested: bool) -> str:
    have = installed(dist)
    if have is None:
        return f"not installed (mlx-fun needs {dist} {wanted}: pip install '{dist}{wanted}')"
    if not tested:
        return f"{have} (mlx-fun needs {wanted})"
    if in_tested_range(have):
        return f"{have} (tested range {wanted})"
    return f"{have}, outside the tested range {wanted}: pip install '{dist}{wanted}'"


def report() -> dict[str, str]:
    """``mlx`` / ``mlx-lm`` versions against the ranges, and ``mlx-lm compat``: "OK: ..." when every private name
    of the table is present, else "MISSING ..." naming each absent one and what needs it."""
    facts = {"mlx": version_line("mlx", MLX_RANGE, tested=False),
             "mlx-lm": version_line("mlx-lm", MLX_LM_RANGE, tested=True)}
    if installed("mlx-lm") is None:
        facts["mlx-lm compat"] = "MISSING mlx-lm itself"
        return facts
    gone = missing()
    required = [row for row in gone if row.features]
    if not gone:
        facts["mlx-lm compat"] = f"OK: all {len(TABLE)} private mlx-lm names mlx-fun uses are present"
        return facts
    listed = "; ".join(f"{row.path} ({', '.join(row.features) or 'optional: ' + ', '.join(row.fallback)})"
                       for row in gone)
    head = "MISSING" if required else "OK, optional names missing"
    facts["mlx-lm compat"] = f"{head} {len(gone)} of {len(TABLE)}: {listed}; {_fix()}"
    return facts
