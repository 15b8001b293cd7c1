"""Loading models and writing outputs atomically.

Every file or directory the toolkit writes goes to a temporary sibling first and is renamed into place only
when complete, so an interrupted run never leaves a half-written output behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import UserError


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, suffix: str = ""):
    """Yield a temporary path next to ``path``; rename it onto ``path`` when the block succeeds.

    ``suffix`` is appended to the temporary name (``np.savez`` insists on a ``.npz`` ending).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp" + suffix, dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_json(path: str | os.PathLike, obj) -> None:
    """Write JSON atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory beside ``path``; move it to ``path`` when the block succeeds.

    An existing non-empty ``path`` is an error unless ``overwrite``; then it is replaced only after the new
    directory is complete.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UserError(f"{target} exists and is not a directory; choose another output path.")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise UserError(f"output directory {target} exists and is not empty; pass --force or pick another path.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_config(model_path: str | os.PathLike) -> dict:
    """``config.json`` of a local model directory, with friendly errors."""
    path = Path(model_path)
    if not path.exists():
        raise UserError(f"model path {path} does not exist; pass a local mlx-lm model directory to --model.")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise UserError(f"{path} has no config.json; --model must be an mlx-lm model directory.")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg} is not valid JSON ({e.msg} at line {e.lineno}); fix or re-download the model.")


def load_model(model_path: str | os.PathLike, lazy: bool = False):
    """Load ``(model, tokenizer, config)`` with mlx-lm from a local directory. Never downloads."""
    from mlx_lm import load

    config = read_config(model_path)
    model, tokenizer = load(str(model_path), lazy=lazy)
    return model, tokenizer, config


_WEIGHT_FILES = ("config.json", "model.safetensors.index.json")


def dir_size(path: str | os.PathLike) -> int:
    """Bytes of all files below ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def check_output_dir(output: str | os.PathLike, source: str | os.PathLike, force: bool = False) -> Path:
    """Refuse to write into the input model (or inside it), and into a non-empty directory without --force."""
    out, src = Path(output).resolve(), Path(source).resolve()
    if out == src or src in out.parents:
        raise UserError(f"--output {output} is the input model directory (or inside it); write the result elsewhere.")
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {output} exists and is not a directory; choose another path.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"output directory {output} exists and is not empty; pass --force to replace it.")
    return Path(output)


def save_model_dir(model, config: dict, output, *, source, metadata: dict | None = None, force: bool = False) -> Path:
    """Save ``model`` as an mlx-lm directory at ``output``, atomically (temp dir beside it, then rename).

    Weights and config.json are written with mlx-lm's own ``save_model`` / ``save_config``; every other file of
    the ``source`` directory (tokenizer files, chat template, generation config, ...) is copied; ``metadata``
    maps file names (e.g. ``reap_metadata.json``) to JSON-serialisable objects written beside them (a ``str``
    is written as it is, e.g. a ``README.md`` model card).
    """
    import copy as _copy

    from mlx_lm.utils import save_config, save_model

    out = check_output_dir(output, source, force)
    src = Path(source)
    with atomic_dir(out, overwrite=force) as tmp:
        save_model(tmp, model)
        save_config(_copy.deepcopy(config), config_path=tmp / "config.json")
        for f in src.iterdir():
            if f.is_file() and f.name not in _WEIGHT_FILES and not f.name.endswith(".safetensors"):
                shutil.copy2(f, tmp / f.name)
        for name, obj in (metadata or {}).items():
            text = obj if isinstance(obj, str) else json.dumps(obj, indent=2) + "\n"
            (tmp / name).write_text(text)
    return out


BUNDLED_MODEL_NAME = "tiny-moe"


def bundled_model_dir() -> Path:
    """The trained tiny MoE that ships in the repository's ``data/`` (``$MLX_FUN_DATA`` overrides the folder).

    Looked up beside the package (a source checkout or editable install), then under ``./data``.
    """
    candidates = []
    if os.environ.get("MLX_FUN_DATA"):
        candidates.append(Path(os.environ["MLX_FUN_DATA"]) / BUNDLED_MODEL_NAME)
    candidates += [Path(__file__).resolve().parent.parent / "data" / BUNDLED_MODEL_NAME,
                   Path.cwd() / "data" / BUNDLED_MODEL_NAME]
    for cand in candidates:
        if (cand / "config.json").exists():
            return cand
    raise UserError(
        f"the bundled model data/{BUNDLED_MODEL_NAME} was not found (looked in "
        f"{', '.join(str(c) for c in candidates)}); run from a clone of mlx-fun, set MLX_FUN_DATA to its data/ "
        f"folder, or pass --model."
    )
