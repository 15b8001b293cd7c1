"""LoRA / DoRA adapters on the model a job loads (what ``mlx_lm.lora`` writes: ``adapter_config.json`` and
``adapters.safetensors``), as mlx-lm's ``--adapter-path``, fused into the weights as soon as they are loaded.

mlx-lm's ``load(adapter_path=...)`` wraps each adapted layer (``LoRALinear``, ``LoRASwitchLinear``, ``DoRALinear``,
``LoRAEmbedding``) and adds ``scale · (x A) B`` to its output at every call. mlx-fun's hooks, expert dispatch and
rewrites read router and expert weights directly, so :func:`apply` loads the adapter with mlx-lm's own
``load_adapters`` and then fuses every wrapped layer with its own ``fuse()``, as ``mlx_lm.fuse`` does (not
dequantized): a float weight becomes ``W + scale · (A B)ᵀ`` rounded to its dtype (the function mlx-lm computes, to
that rounding); a quantized one is dequantized, added to and re-quantized with its own bits, group size and mode —
the weights ``mlx_lm.fuse`` writes. A lazily loaded model stays lazy: a fused weight is computed when its layer is
first used (streamed runs read the base weights from the files and add the adapter there). An adapter of
``fine_tune_type: full`` holds whole weights, loaded over the model's.

:data:`ADAPTER_PATH` is the option of every job that runs a forward; :func:`check` reads the adapter's config before
anything loads (one line naming the option and the fix); :func:`describe` is what an output records of it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import click

from ..core.options import Opt
from ..errors import UserError, param

CONFIG, WEIGHTS = "adapter_config.json", "adapters.safetensors"
FINE_TUNE_TYPES = ("lora", "dora", "full")
#: ``--adapter-path``, declared once for every job that loads a model for a forward
ADAPTER_PATH = Opt(f"A LoRA / DoRA adapter directory ({WEIGHTS} + {CONFIG}, as mlx_lm.lora writes) applied to "
                   "--model, as mlx-lm's --adapter-path; fused into the weights when they load (mlx_lm.fuse's "
                   "arithmetic), and recorded in what the command writes.", type=click.Path(file_okay=False),
                   missing="pass the directory mlx_lm.lora wrote (its --adapter-path, adapters/ by default)")


def _fail(path, problem: str) -> UserError:
    return UserError(f"{param('adapter_path')} {path} {problem}")


def check(path: str | os.PathLike) -> dict:
    """The adapter's ``adapter_config.json`` (a JSON object), after checking what mlx-lm's ``load_adapters`` needs
    of the directory: both files, a known ``fine_tune_type``, and for LoRA / DoRA a ``num_layers`` and
    ``lora_parameters`` with ``rank``, ``scale`` and ``dropout``. One line naming the option otherwise."""
    from ..core import json_input
    from ..datasets.samples import json_whole

    where = Path(path)
    if not where.is_dir():
        raise _fail(path, f"is not a directory; pass the directory mlx_lm.lora wrote ({WEIGHTS} + {CONFIG}).")
    for name in (CONFIG, WEIGHTS):
        if not (where / name).is_file():
            raise _fail(path, f"has no {name}; pass the directory mlx_lm.lora wrote ({WEIGHTS} + {CONFIG}).")
    fix = "fix it or pass the directory mlx_lm.lora wrote."
    config = json_input.read(where / CONFIG, fix=fix, expect=dict)
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        raise _fail(path, f"has fine_tune_type {kind!r} in {CONFIG}, not one of {', '.join(FINE_TUNE_TYPES)}; {fix}")
    if kind == "full":
        return config
    lora, layers = config.get("lora_parameters"), config.get("num_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or not isinstance(lora, dict):
        raise _fail(path, f"has no whole num_layers and lora_parameters object in {CONFIG}; {fix}")
    missing = [k for k in ("rank", "scale", "dropout") if not isinstance(lora.get(k), (int, float))
               or isinstance(lora.get(k), bool)]
    if missing or not json_whole(lora["rank"], 1):
        bad = ", ".join(missing) or "rank"
        raise _fail(path, f"has no usable lora_parameters {bad} in {CONFIG} (mlx-lm's LoRA config names the scale "
                          f"'scale', a number, and the rank a whole number >= 1); {fix}")
    return config


def apply(model, path: str | os.PathLike) -> int:
    """Load the adapter at ``path`` onto ``model`` with mlx-lm's ``load_adapters`` and fuse every adapted layer
    (``fuse(dequantize=False)``, as ``mlx_lm.fuse``); returns how many layers were fused. An adapter that does not
    fit the model (trained on another one) is one line naming the option."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import load_adapters

    try:
        load_adapters(model, str(path))
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as e:
        detail = " ".join(str(e).split())[:240]
        raise _fail(path, f"does not fit {param('model')} ({type(e).__name__}: {detail}); pass the adapter "
                          f"trained on this model.") from None
    from mlx.utils import tree_flatten

    model.eval()
    fused = [(name, module.fuse(dequantize=False)) for name, module in model.named_modules() if hasattr(module, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    prefixes = tuple(f"{name}." for name, _ in fused)
    loaded = set(weight_names(path))  # a full fine-tune's weights, loaded over the model's
    changed = {k for k, _ in tree_flatten(model.parameters()) if k.startswith(prefixes) or k in loaded}
    object.__setattr__(model, ADAPTED, frozenset(changed))  # plain attributes: not parameters of the model
    object.__setattr__(model, REQUANTIZED, sum("scales" in module for _, module in fused))
    return len(fused)


def weight_names(path: str | os.PathLike) -> list[str]:
    """The tensor names in the adapter's weights file (its safetensors header; no tensor is read)."""
    import struct

    from ..core import json_input

    with open(Path(path) / WEIGHTS, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json_input.parse(f.read(n), f"the safetensors header of {Path(path) / WEIGHTS}", expect=dict,
                                  fix="re-save the adapter with mlx_lm.lora.")
    return [k for k in header if k != "__metadata__"]


#: the attribute :func:`apply` leaves on a model: the names of the parameters the adapter changed
ADAPTED = "mlx_fun_adapted_parameters"


def adapted(model) -> frozenset[str]:
    """The parameters of ``model`` an adapter changed when it was loaded (:func:`apply`; empty without one): they
    are no longer the source files' tensors, so a writer never copies them from there."""
    return getattr(model, ADAPTED, frozenset())


#: the attribute :func:`apply` leaves on a model: how many quantized layers it fused and re-quantized
REQUANTIZED = "mlx_fun_requantized_layers"


def note(model) -> str | None:
    """A line for the log when the adapter was fused into quantized layers (None otherwise): they are re-quantized,
    as ``mlx_lm.fuse`` writes them, so the model is the fused one, whose outputs differ from mlx-lm's unfused
    adapter on the quantized base by that rounding."""
    n = getattr(model, REQUANTIZED, 0)
    if not n:
        return None
    return (f"the adapter was fused into {n} quantized layer(s), re-quantized with their own bits as mlx_lm.fuse "
            f"writes them: this runs the fused model, whose outputs differ from mlx-lm's unfused adapter on the "
            f"quantized base by that re-quantization (`mlx_lm.fuse --dequantize` keeps them exact, in float).")


def describe(path: str | os.PathLike | None) -> dict | None:
    """What an output records of the adapter at ``path`` (None: none): its path, fine-tune type, rank, scale and
    adapted layers as its config says, and the sha256 of its weights."""
    if path is None:
        return None
    config = check(path)
    lora = config.get("lora_parameters") or {}
    digest = hashlib.sha256()
    with open(Path(path) / WEIGHTS, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return {"path": str(path), "fine_tune_type": config.get("fine_tune_type", "lora"), "rank": lora.get("rank"),
            "scale": lora.get("scale"), "num_layers": config.get("num_layers"), "fused": True,
            "sha256": digest.hexdigest()}


def recorded(path: str | os.PathLike | None) -> dict:
    """``{"adapter": describe(path)}`` for an output's metadata, ``{}`` without an adapter (outputs of the base
    model stay as they were)."""
    return {} if path is None else {"adapter": describe(path)}


__all__ = ["ADAPTED", "ADAPTER_PATH", "CONFIG", "REQUANTIZED", "WEIGHTS", "adapted", "apply", "check", "describe",
           "note", "recorded"]
