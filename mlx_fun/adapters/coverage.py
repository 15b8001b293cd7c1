"""Which MoE model types the installed mlx-lm ships, and which of them mlx-fun does not know.

A model file is an MoE type when it uses mlx-lm's ``switch_layers`` (``SwitchGLU`` / ``SwitchMLP``), or imports
such a file (wrappers and variants: gemma4, qwen3_vl_moe, kimi_vl, ...), closed under imports. ``doctor`` prints
the unknown ones, so a user who upgrades mlx-lm sees at once which new families have no adapter yet; a test keeps
the list empty for the mlx-lm the project pins.
"""

from __future__ import annotations

import re
from pathlib import Path

_FROM_MODULE = re.compile(r"^from \.(\w+) import", re.M)
_FROM_PACKAGE = re.compile(r"^from \. import ([\w, ]+)", re.M)


def _model_sources() -> dict[str, str]:
    import mlx_lm.models

    root = Path(mlx_lm.models.__file__).parent
    return {p.stem: p.read_text(errors="replace") for p in root.glob("*.py") if p.stem != "switch_layers"}


def mlx_lm_moe_types() -> tuple[list[str], list[str]]:
    """``(files using switch_layers, files importing those)``: model-type names of the installed mlx-lm."""
    sources = _model_sources()
    direct = {name for name, text in sources.items() if "switch_layers" in text}
    closure, grew = set(direct), True
    while grew:
        grew = False
        for name, text in sources.items():
            imported = set(_FROM_MODULE.findall(text))
            imported |= {m.strip() for line in _FROM_PACKAGE.findall(text) for m in line.split(",")}
            if name not in closure and imported & closure:
                closure.add(name)
                grew = True
    return sorted(direct), sorted(closure - direct)


def unknown_moe_types() -> list[str]:
    """MoE model types of the installed mlx-lm that are neither supported nor listed as unsupported."""
    from . import REGISTRY, UNSUPPORTED

    direct, reusers = mlx_lm_moe_types()
    return [t for t in direct + reusers if t not in REGISTRY and t not in UNSUPPORTED]
