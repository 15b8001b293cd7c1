"""An mlx-lm model directory written atomically: weights streamed tensor by tensor
(:mod:`mlx_fun.output.streaming`), config.json, the source's other files and the model card
(:mod:`mlx_fun.output.model_card`), inside a :func:`mlx_fun.core.writer.output` reservation."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import param


_WEIGHT_FILES = ("config.json", "model.safetensors.index.json")
_NOT_COPIED = _WEIGHT_FILES + ("README.md",)  # the source's card describes the source: the output gets its own


def dir_size(path: str | os.PathLike) -> int:
    """Bytes of all files below ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def params_nbytes(model) -> int:
    """Bytes of every parameter of ``model`` as they would be saved (lazy arrays are not evaluated)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def write_model_dir(res, model, config: dict, *, source, metadata: dict | None = None, snapshot=None,
                    rows: dict | None = None, parts=None, max_shard_bytes: int | None = None, donate: bool = False,
                    progress: bool = False):
    """Write ``model`` as an mlx-lm directory into a :func:`mlx_fun.core.writer.output` reservation (``res.tmp``);
    returns the :class:`mlx_fun.output.streaming.WriteStats`.

    Weights are written tensor by tensor (:func:`mlx_fun.output.streaming.write_weights`: what ``snapshot`` proves
    untouched is copied from the source files, ``rows`` are kept rows of them, ``parts`` are copied from a streamed
    rewrite's per-layer files (:class:`mlx_fun.output.streaming.Parts`), the rest is evaluated one tensor at a
    time; mlx-lm's names, shard rule and index), config.json with mlx-lm's ``save_config``; every other file of
    the ``source`` directory (tokenizer files, chat template, generation config, ...) is copied but its
    ``README.md``; ``metadata`` maps file names (e.g. ``reap_metadata.json``) to JSON-serialisable objects written
    beside them (a ``str`` is written as it is; a JSON object gets ``base_model``: the repo id, revision and commit
    of :func:`mlx_fun.model.hub.source` when ``source`` came from a Hugging Face repo, else ``{"path": <its absolute
    path>}``).
    The model card ``README.md`` is written by
    :func:`mlx_fun.output.model_card.card` from that metadata (base model, method, settings, measured numbers, the
    source card's license), unless ``metadata`` holds a ``README.md`` of its own. A failing write (a full disk:
    MLX raises ``RuntimeError: [write] Unable to write``) becomes a one-line ``UserError``.
    """
    import copy as _copy

    from mlx_lm.utils import save_config

    from ..model.hub import source as hub_source
    from .streaming import DEFAULT_SHARD_BYTES, write_weights

    dest, src = Path(res.tmp), Path(source)
    try:
        stats = write_weights(dest, model, snapshot=snapshot, rows=rows, parts=parts, donate=donate, progress=progress,
                              max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES)
        save_config(_copy.deepcopy(config), config_path=dest / "config.json")
        for f in src.iterdir():
            if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(".safetensors"):
                shutil.copyfile(f, dest / f.name)  # new files get the user's umask, not the source's mode
        files = {"README.md": _model_card(res, source, metadata), **(metadata or {})}
        # a model resolved from a Hugging Face repo id: its repo id, revision, commit; else the local directory's
        # full path (only here: the card names the directory alone)
        origin = hub_source(src) or {"path": os.path.abspath(src)}
        for name, obj in files.items():
            if isinstance(obj, dict):
                obj = {**obj, "base_model": origin}
            text = obj if isinstance(obj, str) else json.dumps(obj, indent=2) + "\n"
            (dest / name).write_text(text, encoding="utf-8")
    except OSError as e:
        raise res.write_failed(e) from None
    except RuntimeError as e:
        if "write" not in str(e).lower():
            raise
        raise res.write_failed(e) from None
    return stats


def _model_card(res, source, metadata: dict | None) -> str:
    """The output's ``README.md`` (:mod:`mlx_fun.output.model_card`): the base model is ``source``'s Hugging Face repo id
    when known, else its directory's name; sizes are the safetensors bytes of the source and of the weights just
    written into ``res.tmp``."""
    from .model_card import base_model, card, source_front_matter

    if metadata and isinstance(metadata.get("README.md"), str):
        return metadata["README.md"]

    def weights(path) -> int:
        return sum(f.stat().st_size for f in Path(path).glob("*.safetensors") if f.is_file())

    base, provenance = base_model(source)
    return card(metadata, base=base, provenance=provenance, output=res.shown, source_card=source_front_matter(source),
                size_before=weights(source) or None, size_after=weights(res.tmp))


def save_model_dir(model, config: dict, output, *, source, metadata: dict | None = None, force: bool = False,
                   inputs: dict | None = None) -> Path:
    """Save ``model`` as an mlx-lm directory at ``output`` atomically, refusing to touch ``source`` (and
    ``inputs``, flag → path): the library form of what ``prune`` and ``merge`` write."""
    from ..core.writer import output as reserve

    with reserve(output, kind="dir", inputs={param("model"): source, **(inputs or {})}, force=force) as res:
        res.require_space(params_nbytes(model))
        write_model_dir(res, model, config, source=source, metadata=metadata)
    return Path(output)
