"""Reading a model: its config checked without weights, its tokenizer files, mlx-lm's loader, its context length,
the bundled model. Writing one is :mod:`mlx_fun.output.model_dir`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UserError, param


def read_config(model_path: str | os.PathLike) -> dict:
    """``config.json`` of a local model directory, with friendly errors, checked by :func:`check_config` (so
    every command that takes a model refuses a malformed config in one line, before anything loads)."""
    path = Path(model_path)
    if not path.exists():
        raise UserError(f"model path {path} does not exist; pass a local mlx-lm model directory or a Hugging Face repo "
                        f"id (org/name) to {param('model')}.")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise UserError(f"{path} has no config.json; {param('model')} must be an mlx-lm model directory.")
    from ..core import json_input

    # NaN / Infinity pass here (Python's json writes them into configs): check_config refuses them where they matter
    config = json_input.read(cfg, fix="fix or re-download the model.", allow_nan=True)
    check_config(config, where=cfg)
    return config


def check_config(config, *, where: str | os.PathLike) -> None:
    """The one check of a model's config (``where``: the file, for messages): a JSON object whose ``model_type``
    and ``text_config`` have the right types, whose sizes (:data:`COUNT_KEYS`: layers, hidden size, heads,
    vocabulary, ...) are whole numbers from 1 to :data:`mlx_fun.datasets.samples.MAX_COUNT`, whose expert facts make sense for
    the family's adapter (routed experts, top-k at most their count: :meth:`~mlx_fun.adapters.base.MoEAdapter.check_config`),
    and from which mlx-lm can build its model arguments (no required key missing). A type without an mlx-fun
    adapter is left to the caller, which names what it supports (:func:`load_model` turns mlx-lm's complaint into
    one line)."""
    from ..adapters import REGISTRY
    from ..datasets.samples import json_type_name

    fix = "fix it or re-download the model."
    if not isinstance(config, dict):
        raise UserError(f"{where} holds {json_type_name(config)}, not a JSON object of model settings; {fix}")
    for key, kind, want in (("model_type", str, "a string"), ("text_config", dict, "an object")):
        if key in config and not isinstance(config[key], kind):
            raise UserError(f"{where}: {key!r} must be {want}, got {json_type_name(config[key])}; {fix}")
    _check_counts(config, where, fix)
    model_type = config.get("model_type")
    if model_type in REGISTRY:  # other types: mlx-fun's commands name what they support, load_model mlx-lm's error
        REGISTRY[model_type].check_config(config, where=where)
        _check_model_args(config, where, fix)


#: sizes every model's config.json gives as whole numbers >= 1 where it has them (0 layers or heads builds nothing or
#: divides by zero in mlx-lm; 1e30 or "48" is no count); top-level or under ``text_config``
COUNT_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "moe_intermediate_size")


def _check_counts(config: dict, where, fix: str) -> None:
    from ..datasets.samples import MAX_COUNT, json_type_name, json_whole

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for cfg, prefix in ((config, ""), (text, "text_config.")):
        for key in COUNT_KEYS:
            value = cfg.get(key)
            if value is not None and not (json_whole(value, 1) and value <= MAX_COUNT):
                raise UserError(f"{where}: {prefix}{key} must be a whole number from 1 to {MAX_COUNT:,}, got "
                                f"{json_type_name(value)} {json.dumps(value)[:40]}; {fix}")


def _check_model_args(config: dict, where, fix: str) -> None:
    """mlx-lm's ``ModelArgs.from_dict(config)``, the step of its loader that a missing key fails, before any
    weight is read; an unknown ``model_type`` is left to the caller. It imports the model's file alone
    (:func:`mlx_fun.mlx_lm_compat.model_classes`, with mlx-lm's package ``__init__`` deferred:
    :func:`mlx_fun.runtime.lean_imports.defer_mlx_lm`): no tokenizer code, no transformers."""
    from .. import mlx_lm_compat
    from ..runtime import lean_imports

    lean_imports.defer_mlx_lm()
    try:
        _model, args_class = mlx_lm_compat.model_classes(config)
    except ValueError:
        return
    try:
        args_class.from_dict(config)
    except Exception as e:  # noqa: BLE001 -- a missing argument (TypeError), a value __post_init__ refuses, ...
        detail = " ".join(str(e).split())[:200]
        raise UserError(f"{where} does not describe a {config['model_type']} model mlx-lm can build "
                        f"({type(e).__name__}: {detail}); {fix}") from None


#: files that hold a tokenizer's vocabulary (a fast tokenizer, sentencepiece, BPE / WordPiece vocabularies)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
#: and such files named after their format (``spiece.model``, ``qwen.tiktoken``, ...)
TOKENIZER_SUFFIXES = (".model", ".tiktoken")


def check_tokenizer(model_path: str | os.PathLike) -> None:
    """A one-line ``UserError`` when the model directory holds no tokenizer vocabulary (mlx-lm would load an
    empty tokenizer from it, which encodes every prompt to nothing)."""
    path = Path(model_path)
    names = [f.name for f in path.iterdir() if f.is_file()]
    if any(n in TOKENIZER_FILES or n.endswith(TOKENIZER_SUFFIXES) for n in names):
        return
    raise UserError(f"{path} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} (nor another "
                    f"*{' / *'.join(TOKENIZER_SUFFIXES)} vocabulary) is in it; copy the original model's tokenizer "
                    f"files into the directory.")


def load_model(model_path: str | os.PathLike, lazy: bool = False, *, flag: str | None = None,
               config: dict | None = None, tokenizer: bool = True, adapter_path: str | os.PathLike | None = None,
               trust_remote_code: bool = False):
    """Load ``(model, tokenizer, config)`` with mlx-lm from a local directory. Never downloads; a directory mlx-lm
    cannot load (a missing or truncated shard, an unknown model type, no tokenizer) is a one-line ``UserError``
    naming ``flag`` (default: the ``model`` parameter). ``config``: the directory's config, already read and
    checked (with its tokenizer files) by the caller; None reads and checks it here. ``tokenizer=False``: the
    tokenizer is not loaded (None in its place), so a job that only rewrites weights never imports transformers
    (:mod:`mlx_fun.runtime.lean_imports`). ``adapter_path``: a LoRA / DoRA adapter fused into the weights once they
    load (:func:`mlx_fun.model.lora.apply`); ``trust_remote_code``: mlx-lm's (the tokenizer's and a config's
    ``model_file`` code may run)."""
    flag = flag or param("model")
    if config is None:
        config = read_config(model_path)
        check_tokenizer(model_path)
    if adapter_path is not None:
        from . import lora

        lora.check(adapter_path)
    remote = {"trust_remote_code": True, "tokenizer_config": {"trust_remote_code": True}} if trust_remote_code else {}
    try:
        if tokenizer:
            from mlx_lm.utils import load  # mlx_lm.load itself; the package's __init__ would import generate too

            model, tok = load(str(model_path), lazy=lazy, **remote)
        else:
            from mlx_lm.utils import load_model as load_weights

            model, _ = load_weights(Path(model_path), lazy=lazy, **({"trust_remote_code": True} if trust_remote_code
                                                                    else {}))
            tok = None
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:  # a missing/corrupt shard, a bad value, ...
        detail = " ".join(str(e).split())[:240]
        if "not in model" in detail or "Expected shape" in detail:  # weights the config does not describe
            zero = [f"{k} = 0" for cfg in (config, config.get("text_config") or {}) if isinstance(cfg, dict)
                    for k, v in cfg.items() if "expert" in k and v == 0 and not isinstance(v, bool)]
            said = f" (it sets {', '.join(zero)}: a dense model)" if zero else ""
            raise UserError(f"{flag} {model_path}: config.json does not describe the weights beside it{said}; fix "
                            f"config.json or re-download the model (mlx-lm: {detail[:160]}).") from None
        raise UserError(f"could not load {flag} {model_path} with mlx-lm ({type(e).__name__}: {detail}); check that it is "
                        f"a complete mlx-lm model directory (an interrupted download or copy?).") from None
    if adapter_path is not None:
        lora.apply(model, adapter_path)
    return model, tok, config


def context_length(config: dict) -> int | None:
    """The longest sequence the model was built for (``max_position_embeddings``, also under ``text_config``)."""
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


BUNDLED_MODEL_NAME = "tiny-moe"


def bundled_model_dir() -> Path:
    """The trained tiny MoE that ships in the repository's ``data/`` (``$MLX_FUN_DATA`` overrides the folder).

    Looked up beside the package (a source checkout or editable install), then under ``./data``.
    """
    candidates = []
    if os.environ.get("MLX_FUN_DATA"):
        candidates.append(Path(os.environ["MLX_FUN_DATA"]) / BUNDLED_MODEL_NAME)
    candidates += [Path(__file__).resolve().parents[2] / "data" / BUNDLED_MODEL_NAME,
                   Path.cwd() / "data" / BUNDLED_MODEL_NAME]
    for cand in candidates:
        if (cand / "config.json").exists():
            return cand
    raise UserError(
        f"the bundled model data/{BUNDLED_MODEL_NAME} was not found (looked in "
        f"{', '.join(str(c) for c in candidates)}); run from a clone of mlx-fun, set MLX_FUN_DATA to its data/ "
        f"folder, or pass {param('model')}."
    )
