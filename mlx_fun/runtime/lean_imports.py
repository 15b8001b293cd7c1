"""A command pays only for the libraries it uses: no PyTorch ever, no transformers where nothing is tokenized, no
mlx-lm tokenizer code (nor huggingface_hub's HTTP stack) before a command's work starts.

``import mlx_lm`` imports transformers (its tokenizer wrapper, its generate module), and transformers imports
PyTorch wherever PyTorch is installed: 15-18 s before an mlx-fun command starts on a typical ML host, although no
command uses PyTorch (mlx-lm's tokenizers are the fast, Rust ``tokenizers`` ones) and the rewriting commands
(prune, quantize, amplify, stats-*, tune-dispatch) never tokenize at all. Every ``import mlx_lm.<anything>`` runs
mlx-lm's package ``__init__`` first, which imports ``convert``, ``generate`` and ``utils``, and so the tokenizer
code and transformers: 2.4 s on a GPU host with PyTorch, even for the config check, which needs one model file.

- :func:`block_torch`: while transformers itself is imported, ``sys.modules["torch"] = None`` (Python's documented
  way to make a module unimportable): transformers finds no PyTorch (``importlib.util.find_spec`` answers None),
  caches that, and loads its tokenizers without it; afterwards ``torch`` is importable again for anyone else.
- :func:`defer_mlx_lm`: mlx-lm's package ``__init__`` runs the first time a name of the package itself is used
  (``from mlx_lm import load``, ``mlx_lm.generate``); until then its submodules import alone, so
  ``mlx_lm.models.<type>`` (what the config check reads, :mod:`mlx_fun.model.io`) costs that model file.
- :func:`defer_tokenizers`: that, and mlx-lm's models, loading and saving (``mlx_lm.models.*``, ``mlx_lm.utils``)
  imported without its tokenizer module: ``mlx_lm.tokenizer_utils`` is a stand-in whose names are placeholders
  that import the real module (and transformers) the first time anything uses them (a call, an attribute, an
  ``isinstance``); ``huggingface_hub.snapshot_download``, which ``mlx_lm.utils`` takes by name, is such a
  placeholder too (huggingface_hub's HTTP stack costs 0.2-0.5 s; a local model needs none of it). A command that
  loads no tokenizer never imports transformers.
- :func:`defer_transformers`: mlx-lm's real tokenizer and generate modules imported without transformers (2.4-3 s
  on a GPU host with PyTorch): while they import, ``transformers`` is a stand-in whose
  ``AutoTokenizer.from_pretrained`` answers a tokenizer without transformers where the caller's loader
  (:mod:`mlx_fun.model.fast_tokenizer`) accepts the directory, and every other name imports transformers itself
  and rebinds what mlx-lm took from the stand-in. A command that tokenizes such a model never imports transformers.

The console entry calls :func:`block_torch` and :func:`defer_mlx_lm` for every command, :func:`defer_tokenizers`
for those that never tokenize and :func:`defer_transformers` for the others (:mod:`mlx_fun.launcher`), before
anything imports mlx-lm; the config check calls :func:`defer_mlx_lm` (a process that has not imported mlx-lm yet
gets the package whole on first use of one of its names, as before); importing ``mlx_fun`` as a library changes
nothing. ``MLX_FUN_EAGER_IMPORTS=1`` turns them all off (imports as mlx-lm makes them: for a tokenizer with remote
code that needs PyTorch, and the before/after of ``scripts/benchmarks/bench_startup.py``).
"""

from __future__ import annotations

import contextlib
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


class _Around:
    """A ``sys.meta_path`` finder for one module, ``name``: its import runs inside ``around()`` (a context manager).
    Used once: the real finders locate the module, and this one steps aside."""

    def __init__(self, name: str, around):
        self.name, self.around = name, around

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _AroundLoader(spec.loader, self.around)
        return spec


class _AroundLoader:
    def __init__(self, loader, around):
        self.loader, self.around = loader, around

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with self.around():
            self.loader.exec_module(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _install(name: str, around) -> None:
    if name not in sys.modules and not any(isinstance(f, _Around) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Around(name, around))


@contextlib.contextmanager
def _torch_hidden():
    """transformers' import with PyTorch unimportable, so it settles (and caches) that PyTorch is absent;
    afterwards ``torch`` is importable again, so other libraries that look it up in ``sys.modules`` (scipy's
    array-API helpers) see it absent, not broken."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # Python's documented "not importable": find_spec answers None
    try:
        yield
        checks = sys.modules.get("transformers.utils.import_utils")
        if checks is not None and hasattr(checks, "is_torch_available"):
            checks.is_torch_available()  # settled (lru-cached) while PyTorch is hidden
    finally:
        if blocked and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def block_torch() -> bool:
    """Let transformers import as if PyTorch were not installed (:func:`_torch_hidden`) unless it or
    PyTorch is already imported or :func:`eager`; returns whether it is set up."""
    if eager() or "torch" in sys.modules or "transformers" in sys.modules:
        return False
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" (mlx-lm sets it too)
    _install("transformers", _torch_hidden)
    return True


_TOKENIZER_UTILS = "mlx_lm.tokenizer_utils"
_HUB = "huggingface_hub"
#: the name mlx_lm.utils takes from huggingface_hub (``from huggingface_hub import snapshot_download``)
_DOWNLOAD = "snapshot_download"


def _finish_mlx_lm():
    """Undo :func:`defer_tokenizers` and :func:`defer_mlx_lm`: import mlx-lm's real tokenizer module (and so
    transformers), rebind the names ``mlx_lm.utils`` took from placeholders, and run mlx-lm's ``__init__`` if it was
    skipped. Returns the real tokenizer module."""
    current = sys.modules.get(_TOKENIZER_UTILS)
    if current is not None and not getattr(current, _STANDIN, False):
        real = current
    else:
        sys.modules.pop(_TOKENIZER_UTILS, None)
        real = importlib.import_module(_TOKENIZER_UTILS)
    utils = sys.modules.get("mlx_lm.utils")
    if utils is not None:
        for name, value in list(vars(utils).items()):
            if isinstance(value, _Deferred):  # a tokenizer name from the real module here (its _load comes here)
                tokenizers = value.__module__ == _TOKENIZER_UTILS
                setattr(utils, name, getattr(real, value.__name__) if tokenizers else value._target())
    package = sys.modules.get("mlx_lm")
    if package is not None and getattr(package, _STANDIN, False):
        delattr(package, _STANDIN)
        del package.__getattr__
        package.__spec__.loader.exec_module(package)
    return real


class _Deferred(type):
    """Metaclass of the placeholders: every use resolves the real object (``_load()``) and hands over to it."""

    def _target(cls):
        real = cls.__dict__.get("_resolved")
        if real is None:
            real = cls._load()
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


def _placeholder(name: str, module: str, load) -> _Deferred:
    """A stand-in for ``module.name`` whose first use calls ``load()`` for the real object."""
    return _Deferred(name, (), {"_load": staticmethod(load), "__module__": module})


class _StandIn(types.ModuleType):
    """mlx-lm's tokenizer module, not yet imported: each name is a placeholder for the real one."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        placeholder = _placeholder(name, self.__name__, lambda: getattr(_finish_mlx_lm(), name))
        setattr(self, name, placeholder)
        return placeholder


def _real_download(hub):
    """huggingface_hub's own ``snapshot_download`` (its lazy loader imports it once the placeholder is gone)."""
    if isinstance(vars(hub).get(_DOWNLOAD), _Deferred):
        delattr(hub, _DOWNLOAD)
    return getattr(hub, _DOWNLOAD)


@contextlib.contextmanager
def _download_deferred():
    """While ``mlx_lm.utils`` is imported, ``huggingface_hub.snapshot_download`` is a placeholder (huggingface_hub's
    package loads its names on first use: the name, not the package, costs its HTTP stack); afterwards the package
    is as it was, and ``mlx_lm.utils`` keeps the placeholder until it downloads (or :func:`_finish_mlx_lm`)."""
    try:
        hub = importlib.import_module(_HUB)
    except ImportError:
        hub = None
    placeholder = None
    if hub is not None and _DOWNLOAD not in vars(hub):
        placeholder = _placeholder(_DOWNLOAD, _HUB, lambda: _real_download(hub))
        setattr(hub, _DOWNLOAD, placeholder)
    try:
        yield
    finally:
        if placeholder is not None and vars(hub).get(_DOWNLOAD) is placeholder:
            delattr(hub, _DOWNLOAD)


def _deferred_package(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and getattr(module, _STANDIN, False)


def defer_mlx_lm() -> bool:
    """Let mlx-lm's submodules (``mlx_lm.models.<type>``, ``mlx_lm.utils``) be imported without its package
    ``__init__`` (which imports ``convert``, ``generate`` and ``utils``, and so its tokenizer code and transformers);
    the ``__init__`` runs the first time a name of the package itself is used (``from mlx_lm import load``,
    ``mlx_lm.generate``, ``mlx_lm.__version__``), and the package is then whole. Returns whether the package is
    deferred (now or before); not where mlx-lm is already imported, nor under :func:`eager`."""
    if _deferred_package("mlx_lm"):
        return True
    if "mlx_lm" in sys.modules or eager():
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None:
        return False
    package = importlib.util.module_from_spec(spec)  # the package, its __init__ not run yet

    def __getattr__(name):
        if name.startswith("__") and name.endswith("__") and name not in ("__version__", "__all__"):
            raise AttributeError(name)
        _finish_mlx_lm()
        return getattr(package, name)

    package.__getattr__ = __getattr__
    setattr(package, _STANDIN, True)
    sys.modules["mlx_lm"] = package
    return True


def defer_tokenizers() -> bool:
    """:func:`defer_mlx_lm`, and mlx-lm's models, loading and saving imported without its tokenizer module (and so
    without transformers) until a tokenizer is first used; returns whether it was set up (not where mlx-lm's
    ``utils`` or tokenizer module is already imported).

    ``mlx_lm.utils`` imports as usual, with placeholders for the two tokenizer names it takes and for
    huggingface_hub's ``snapshot_download``. The first use of a tokenizer placeholder imports the real module and
    rebinds them all."""
    if "mlx_lm.utils" in sys.modules or _TOKENIZER_UTILS in sys.modules or not defer_mlx_lm():
        return False
    standin = _StandIn(_TOKENIZER_UTILS)
    setattr(standin, _STANDIN, True)
    sys.modules[_TOKENIZER_UTILS] = standin
    _install("mlx_lm.utils", _download_deferred)
    return True


_TRANSFORMERS = "transformers"
_BASE = "transformers.tokenization_utils_base"
#: mlx-lm's modules that take names from transformers when they are imported (tokenizer_utils: AutoTokenizer,
#: PreTrainedTokenizerFast, PreTrainedTokenizerBase; generate: PreTrainedTokenizer, for type hints only)
_TAKERS = ("mlx_lm.tokenizer_utils", "mlx_lm.generate")


class _Transformers(types.ModuleType):
    """transformers as mlx-lm's tokenizer and generate modules see it while they are imported
    (:func:`defer_transformers`): ``AutoTokenizer.from_pretrained`` answers ``fast(path, kwargs)`` where that is not
    None and is transformers' own otherwise; any other name is transformers' own (:meth:`real`)."""

    def __init__(self, fast, renderer):
        super().__init__(_TRANSFORMERS)
        setattr(self, _STANDIN, True)
        self._fast, self._real, self._registered, self._subclasses = fast, None, [], []
        standin = self

        class AutoTokenizer:
            @staticmethod
            def from_pretrained(path, *args, **kwargs):
                tokenizer = None if args or standin._real is not None else standin._fast(path, kwargs)
                if tokenizer is not None:
                    return tokenizer
                return standin.real().AutoTokenizer.from_pretrained(path, *args, **kwargs)

            @staticmethod
            def register(*args, **kwargs):
                if standin._real is not None:
                    return standin._real.AutoTokenizer.register(*args, **kwargs)
                standin._registered.append((args, kwargs))

        class PreTrainedTokenizerFast:  # a base for mlx-lm's NewlineTokenizer until transformers' own replaces it
            def __init_subclass__(cls, **kwargs):
                super().__init_subclass__(**kwargs)
                standin._subclasses.append(cls)

        base = types.ModuleType(_BASE)
        #: mlx-lm compares a tokenizer's apply_chat_template with this one's to tell a custom renderer
        base.PreTrainedTokenizerBase = type("PreTrainedTokenizerBase", (), {"apply_chat_template": renderer})
        self.tokenization_utils_base = base
        self.AutoTokenizer, self.PreTrainedTokenizerFast = AutoTokenizer, PreTrainedTokenizerFast
        self.PreTrainedTokenizer = _placeholder("PreTrainedTokenizer", _TRANSFORMERS,
                                                lambda: self.real().PreTrainedTokenizer)
        self._names = {name: getattr(self, name) for name in (
            "AutoTokenizer", "PreTrainedTokenizerFast", "PreTrainedTokenizer")}
        self._names["PreTrainedTokenizerBase"] = base.PreTrainedTokenizerBase

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(self.real(), name)

    def real(self):
        """transformers itself, imported now (PyTorch hidden, :func:`block_torch`): mlx-lm's NewlineTokenizer
        rebased on its PreTrainedTokenizerFast, the recorded ``register`` calls replayed, and every name mlx-lm's
        modules took from the stand-in rebound to transformers' own."""
        if self._real is not None:
            return self._real
        for name in (_TRANSFORMERS, _BASE):
            if sys.modules.get(name) is self or sys.modules.get(name) is self.tokenization_utils_base:
                del sys.modules[name]
        real = importlib.import_module(_TRANSFORMERS)
        own = {"AutoTokenizer": real.AutoTokenizer, "PreTrainedTokenizerFast": real.PreTrainedTokenizerFast,
               "PreTrainedTokenizer": real.PreTrainedTokenizer,
               "PreTrainedTokenizerBase": importlib.import_module(_BASE).PreTrainedTokenizerBase}
        for cls in self._subclasses:
            cls.__bases__ = tuple(own["PreTrainedTokenizerFast"] if b is self.PreTrainedTokenizerFast else b
                                  for b in cls.__bases__)
        for args, kwargs in self._registered:
            real.AutoTokenizer.register(*args, **kwargs)
        self._real = real
        for taker in _TAKERS:
            module = sys.modules.get(taker)
            for name, value in list(vars(module).items()) if module is not None else ():
                if name in self._names and value is self._names[name]:
                    setattr(module, name, own[name])
        return real


@contextlib.contextmanager
def _transformers_standing_in(standin: _Transformers):
    """While one of :data:`_TAKERS` is imported, ``import transformers`` is ``standin`` (unless transformers itself
    is imported by then); afterwards it is transformers again for everyone else."""
    if standin._real is not None or sys.modules.get(_TRANSFORMERS) is not None:
        yield
        return
    sys.modules[_TRANSFORMERS], sys.modules[_BASE] = standin, standin.tokenization_utils_base
    try:
        yield
    finally:
        for name, module in ((_TRANSFORMERS, standin), (_BASE, standin.tokenization_utils_base)):
            if sys.modules.get(name) is module:
                del sys.modules[name]


def defer_transformers(*, fast, renderer) -> bool:
    """Let mlx-lm's tokenizer and generate modules import without transformers: they take their transformers
    names from a stand-in whose ``AutoTokenizer.from_pretrained(path, **kwargs)`` answers ``fast(path, kwargs)``
    (a tokenizer without transformers, :mod:`mlx_fun.model.fast_tokenizer`, or None where transformers must load
    it) and is transformers' own otherwise; ``renderer`` is the fast tokenizer's ``apply_chat_template`` (mlx-lm
    compares it with ``PreTrainedTokenizerBase``'s to tell a custom chat renderer). The first name that needs
    transformers imports it and rebinds every name mlx-lm took from the stand-in. ``mlx_lm.utils`` takes
    huggingface_hub's ``snapshot_download`` as a placeholder, as under :func:`defer_tokenizers`. Returns whether it
    was set up (not under :func:`eager`, nor where transformers or those modules are already imported)."""
    if eager() or sys.modules.get(_TRANSFORMERS) is not None or any(t in sys.modules for t in _TAKERS):
        return False
    standin = _Transformers(fast, renderer)
    for taker in _TAKERS:
        _install(taker, lambda: _transformers_standing_in(standin))
    if "mlx_lm.utils" not in sys.modules:  # a local model needs no download: no HTTP stack either
        _install("mlx_lm.utils", _download_deferred)
    return True


def transformers_imported() -> bool:
    """Whether transformers has been imported in this process."""
    return sys.modules.get("transformers") is not None


__all__ = ["EAGER_ENV", "block_torch", "defer_mlx_lm", "defer_tokenizers", "defer_transformers", "eager",
           "transformers_imported"]
