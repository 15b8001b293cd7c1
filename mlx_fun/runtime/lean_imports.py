"""A command pays only for the libraries it uses: no PyTorch ever, no transformers where nothing is tokenized.

``import mlx_lm`` imports transformers (its tokenizer wrapper, its generate module), and transformers imports
PyTorch wherever PyTorch is installed: 15-18 s before an mlx-fun command starts on a typical ML host, although no
command uses PyTorch (mlx-lm's tokenizers are the fast, Rust ``tokenizers`` ones) and the rewriting commands
(prune, quantize, amplify, stats-*, tune-dispatch) never tokenize at all.

- :func:`block_torch`: while transformers itself is imported, ``sys.modules["torch"] = None`` (Python's documented
  way to make a module unimportable): transformers finds no PyTorch (``importlib.util.find_spec`` answers None),
  caches that, and loads its tokenizers without it; afterwards ``torch`` is importable again for anyone else.
- :func:`defer_tokenizers`: mlx-lm's models, loading and saving (``mlx_lm.models.*``, ``mlx_lm.utils``) are
  imported without its tokenizer module: ``mlx_lm.tokenizer_utils`` is a stand-in whose names are placeholders
  that import the real module (and transformers) the first time anything uses them (a call, an attribute, an
  ``isinstance``), and mlx-lm's package ``__init__`` runs when a name of the package itself is first used. A
  command that loads no tokenizer never imports transformers.

Both are process-wide and only the ``mlx-fun`` console entry calls them (:mod:`mlx_fun.launcher`), before anything imports
mlx-lm; importing ``mlx_fun`` as a library changes nothing. ``MLX_FUN_EAGER_IMPORTS=1`` turns both off (imports as
mlx-lm makes them: for a tokenizer with remote code that needs PyTorch, and the before/after of
``scripts/benchmarks/bench_startup.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

EAGER_ENV = "MLX_FUN_EAGER_IMPORTS"
_STANDIN = "_mlx_fun_standin"


def eager() -> bool:
    """``MLX_FUN_EAGER_IMPORTS=1``: import as mlx-lm does (PyTorch allowed, the tokenizer module at once)."""
    from ..core.env import flag

    return flag(EAGER_ENV)


class _TransformersWithoutTorch:
    """A ``sys.meta_path`` finder for ``transformers`` alone: its import runs with PyTorch unimportable, so
    transformers settles (and caches) that PyTorch is absent; afterwards ``torch`` is importable again, so other
    libraries that look it up in ``sys.modules`` (scipy's array-API helpers) see it absent, not broken."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # once: the real finders locate the package
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _NoTorchLoader(spec.loader)
        return spec


class _NoTorchLoader:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        blocked = "torch" not in sys.modules
        if blocked:
            sys.modules["torch"] = None  # Python's documented "not importable": find_spec answers None
        try:
            self.loader.exec_module(module)
            checks = sys.modules.get("transformers.utils.import_utils")
            if checks is not None and hasattr(checks, "is_torch_available"):
                checks.is_torch_available()  # settled (lru-cached) while PyTorch is hidden
        finally:
            if blocked and sys.modules.get("torch", 0) is None:
                del sys.modules["torch"]

    def __getattr__(self, name):
        return getattr(self.loader, name)


def block_torch() -> bool:
    """Let transformers import as if PyTorch were not installed (:class:`_TransformersWithoutTorch`) unless it or
    PyTorch is already imported or :func:`eager`; returns whether it is set up."""
    if eager() or "torch" in sys.modules or "transformers" in sys.modules:
        return False
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" (mlx-lm sets it too)
    if not any(isinstance(f, _TransformersWithoutTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _TransformersWithoutTorch())
    return True


_TOKENIZER_UTILS = "mlx_lm.tokenizer_utils"


def _finish_mlx_lm():
    """Undo :func:`defer_tokenizers`: import mlx-lm's real tokenizer module (and so transformers), rebind the
    names ``mlx_lm.utils`` took from the stand-in, and run mlx-lm's ``__init__`` if it was skipped. Returns the
    real tokenizer module."""
    current = sys.modules.get(_TOKENIZER_UTILS)
    if current is not None and not getattr(current, _STANDIN, False):
        return current
    sys.modules.pop(_TOKENIZER_UTILS, None)
    real = importlib.import_module(_TOKENIZER_UTILS)
    utils = sys.modules.get("mlx_lm.utils")
    if utils is not None:
        for name, value in list(vars(utils).items()):
            if isinstance(value, _Deferred):
                setattr(utils, name, value._target())
    package = sys.modules["mlx_lm"]
    if getattr(package, _STANDIN, False):
        delattr(package, _STANDIN)
        del package.__getattr__
        package.__spec__.loader.exec_module(package)
    return real


class _Deferred(type):
    """Metaclass of the stand-in's names: every use resolves the real object and hands over to it."""

    def _target(cls):
        real = cls.__dict__.get("_resolved")
        if real is None:
            real = getattr(_finish_mlx_lm(), cls._name)
            type.__setattr__(cls, "_resolved", real)
        return real

    def __call__(cls, *args, **kwargs):
        return cls._target()(*args, **kwargs)

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(cls._target(), name)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls._target())

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls._target())


class _StandIn(types.ModuleType):
    """mlx-lm's tokenizer module, not yet imported: each name is a placeholder for the real one."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        placeholder = _Deferred(name, (), {"_name": name, "__module__": self.__name__})
        setattr(self, name, placeholder)
        return placeholder


def defer_tokenizers() -> bool:
    """Let mlx-lm's models, loading and saving be imported without its tokenizer module (and so without
    transformers) until a tokenizer is first used; returns whether it was set up (not when mlx-lm is already
    imported).

    mlx-lm's package ``__init__`` (which imports ``generate``, and so the tokenizer) runs the first time a name of
    the package itself is used (``from mlx_lm import load``); its submodules (``mlx_lm.utils``,
    ``mlx_lm.models.*``) import as usual, ``mlx_lm.utils`` with placeholders for the two tokenizer names it takes.
    The first use of a placeholder imports the real module and rebinds them."""
    if "mlx_lm" in sys.modules or eager():
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None:
        return False
    package = importlib.util.module_from_spec(spec)  # the package, its __init__ not run yet

    def __getattr__(name):
        if name.startswith("__") and name.endswith("__") and name != "__version__":
            raise AttributeError(name)
        _finish_mlx_lm()
        return getattr(package, name)

    package.__getattr__ = __getattr__
    setattr(package, _STANDIN, True)
    standin = _StandIn(_TOKENIZER_UTILS)
    setattr(standin, _STANDIN, True)
    sys.modules["mlx_lm"] = package
    sys.modules[_TOKENIZER_UTILS] = standin
    return True


def transformers_imported() -> bool:
    """Whether transformers has been imported in this process."""
    return sys.modules.get("transformers") is not None


__all__ = ["EAGER_ENV", "block_torch", "defer_tokenizers", "eager", "transformers_imported"]
