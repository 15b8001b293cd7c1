"""The one class-swap helper: give a module instance a different ``__call__`` without touching its weights.

Python looks special methods up on the type, so patching ``obj.__call__`` does nothing, and wrapping a module in
another one changes its weight keys. Instead ``swap(obj, tag, call)`` sets ``obj.__class__`` to a subclass of its
class whose ``__call__`` is ``call`` (one subclass per (class, tag, call), cached), remembering the original class
on the subclass; ``restore(obj, tag)`` puts it back. Per-instance state goes in the instance ``__dict__`` via
:func:`set_state` (``object.__setattr__``: outside the module's parameter tree, so saved files never change).

Users: :mod:`mlx_fun.model.moe_hook` (tag ``hook``: MoE blocks), :mod:`mlx_fun.dispatch.experts` (tag ``dispatch``: expert
``SwitchGLU``\\ s), :mod:`mlx_fun.model.layerwise` (tag ``layerwise``: decoder layers), :mod:`mlx_fun.serve.counting`
(tag ``serve``: the served model's own ``__call__``). Different tags stack: a block can
be hooked while its experts are dispatched.
"""

from __future__ import annotations

from typing import Callable

_SUBCLASSES: dict[tuple[type, str, Callable], type] = {}
_EPOCH = [0]


def epoch() -> int:
    """A counter that moves on every swap, restore and state change: a graph traced through swapped calls (the
    hooked call's compiled decode graph, :mod:`mlx_fun.model.moe_hook`) is stale once it moves."""
    return _EPOCH[0]


def _changed() -> None:
    _EPOCH[0] += 1


def _marker(tag: str) -> str:
    return f"_mlxfun_{tag}_original"


def original_class(obj, tag: str) -> type | None:
    """The class ``obj`` had before ``swap(obj, tag, ...)``, or None when it is not swapped under ``tag``."""
    return type(obj).__dict__.get(_marker(tag))


def is_swapped(obj, tag: str) -> bool:
    return original_class(obj, tag) is not None


def swapped_class(cls: type, tag: str, call: Callable, name: str | None = None) -> type:
    """The cached subclass of ``cls`` whose ``__call__`` is ``call``."""
    key = (cls, tag, call)
    sub = _SUBCLASSES.get(key)
    if sub is None:
        sub = type(name or f"{tag.capitalize()}{cls.__name__}", (cls,), {"__call__": call, _marker(tag): cls})
        _SUBCLASSES[key] = sub
    return sub


def register(cls: type, tag: str, call: Callable, sub: type) -> None:
    """Use the hand-written ``sub`` (a subclass of ``cls`` with ``__call__ = call``) as the swapped class of ``cls``
    (``dispatch`` names its plain-SwitchGLU subclass ``DispatchedSwitchGLU``)."""
    setattr(sub, _marker(tag), cls)
    _SUBCLASSES[(cls, tag, call)] = sub


def swap(obj, tag: str, call: Callable, name: str | None = None) -> None:
    """Make ``obj`` call ``call(obj, ...)``; a no-op when it is already swapped under ``tag``."""
    if not is_swapped(obj, tag):
        obj.__class__ = swapped_class(type(obj), tag, call, name)
        _changed()


def restore(obj, tag: str) -> bool:
    """Put back the class ``obj`` had before :func:`swap` under ``tag``; True if it was swapped."""
    original = original_class(obj, tag)
    if original is None:
        return False
    obj.__class__ = original
    _changed()
    return True


def set_state(obj, key: str, value) -> None:
    """Per-instance state outside the parameter tree (``mlx.nn.Module.__setattr__`` would register arrays)."""
    object.__setattr__(obj, key, value)
    _changed()


def get_state(obj, key: str, default=None):
    return obj.__dict__.get(key, default)


def drop_state(obj, key: str) -> None:
    if obj.__dict__.pop(key, None) is not None:
        _changed()
