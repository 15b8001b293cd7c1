"""Tiny random MoE models of every supported family, with a locally trained byte-level BPE tokenizer.

Used by ``scripts/tools/make_tiny_moe.py``, by the test fixtures and by the quick-start. Nothing here touches the
network: the tokenizer is trained on text that ships with Python itself (standard-library sources).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from importlib import resources
from pathlib import Path

DEFAULT_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUANT_MODES = {"affine": (32, None), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


def tiny_configs() -> dict:
    """The tiny configs (one per family) that build and run in mlx-lm."""
    text = resources.files("mlx_fun.testing").joinpath("tiny_configs.json").read_text()
    return json.loads(text)


def tiny_model_types() -> list[str]:
    return sorted(tiny_configs())


def _stdlib_corpus(max_chars: int = 400_000) -> list[str]:
    """Plain text from the standard library's own sources: present on every Python install."""
    import inspect
    import json as _json
    import textwrap as _tw
    import argparse as _ap
    import collections as _col
    import string as _string
    import pathlib as _pl

    texts, total = [], 0
    for mod in (_tw, _string, _json, _col, _pl, _ap, inspect):
        try:
            src = inspect.getsource(mod)
        except (OSError, TypeError):
            continue
        texts.append(src)
        total += len(src)
        if total > max_chars:
            break
    # a little English so prose tokenizes into words, not bytes
    texts.append(
        "The quick brown fox jumps over the lazy dog. Mixture of experts models route each token to a few "
        "experts. Hello world! What is the capital of France? Paris is the capital of France."
    )
    return texts


def train_tokenizer(out_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB, texts=None) -> None:
    """Train a byte-level BPE on local text and save it as a Hugging Face fast tokenizer.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (with a chat template) and ``special_tokens_map.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else _stdlib_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    eos = "<|im_end|>"
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos,
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "unk_token": None,
                "model_max_length": 1_000_000,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": eos, "pad_token": "<|endoftext|>"}, indent=2)
    )


def tiny_config(model_type: str, vocab_size: int = DEFAULT_VOCAB, **overrides) -> dict:
    """The tiny config of a family, with the tokenizer's vocabulary size and any overrides applied.

    Overrides go into ``text_config`` for families that keep their text model there (qwen3_5_moe).
    """
    configs = tiny_configs()
    if model_type not in configs:
        raise ValueError(f"No tiny config for model_type '{model_type}'. Known: {', '.join(sorted(configs))}")
    cfg = copy.deepcopy(configs[model_type])
    target = cfg["text_config"] if "text_config" in cfg else cfg
    target["vocab_size"] = vocab_size
    if target is not cfg and "vocab_size" in cfg:  # wrappers that also keep it at the top (gemma4)
        cfg["vocab_size"] = vocab_size
    if "num_vocab" in target:  # phixtral's name for it
        target["num_vocab"] = vocab_size
    target.update(overrides)
    # mlx-lm reads eos ids from config.json when present
    cfg["eos_token_id"] = SPECIAL_TOKENS.index("<|im_end|>")
    return cfg


def _randomize_zero_router_params(model, seed: int) -> None:
    """Give routers non-trivial weights: mlx-lm initialises MoEGate weights, correction biases and router
    biases to zero, which makes every token tie on every expert. Biases of experts get small values too, so
    that bias handling (gpt-oss) is exercised."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed + 7)
    updates = []
    for name, value in tree_flatten(model.parameters()):
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        is_router = parent in ("gate", "router") or leaf in ("e_score_correction_bias", "expert_bias", "router_bias")
        is_expert_bias = leaf == "bias" and value.ndim == 2  # SwitchLinear bias (E, out)
        if leaf == "per_expert_scale" and mx.all(value == 1).item():  # gemma4: ones → distinct positive scales
            key, sub = mx.random.split(key)
            updates.append((name, (1.0 + 0.25 * mx.random.uniform(-1, 1, value.shape, key=sub)).astype(value.dtype)))
            continue
        if (is_router or is_expert_bias) and not mx.any(value != 0).item():
            key, sub = mx.random.split(key)
            # router logits of unit scale (sigmoid routers unsaturated), small biases
            scale = value.shape[-1] ** -0.5 if leaf == "weight" else 0.05 if is_router else 0.5
            updates.append((name, (mx.random.normal(value.shape, key=sub) * scale).astype(value.dtype)))
    if updates:
        model.update(tree_unflatten(updates))


def build_model(config: dict, seed: int = 0):
    """Instantiate an mlx-lm model of ``config`` with random weights (in memory)."""
    import mlx.core as mx

    from .. import mlx_lm_compat

    mx.random.seed(seed)
    model_cls, args_cls = mlx_lm_compat.model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _randomize_zero_router_params(model, seed)
    mx.eval(model.parameters())
    return model


def quantize(model, config: dict, bits: int = 4, group_size: int | None = None, mode: str = "affine"):
    """Quantize with mlx-lm's own ``quantize_model`` (its per-family predicates included)."""
    from mlx_lm.utils import quantize_model

    default_gs, forced_bits = QUANT_MODES[mode]
    gs = group_size or default_gs
    bits = forced_bits or bits
    return quantize_model(model, config, gs, bits, mode=mode)


def make_tiny_model(
    model_type: str,
    output: str | os.PathLike,
    bits: int | None = None,
    mode: str = "affine",
    group_size: int | None = None,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
    tokenizer_dir: str | os.PathLike | None = None,
    **overrides,
) -> Path:
    """Build a tiny random model of ``model_type`` and save it as an mlx-lm directory at ``output``.

    ``bits`` (or a non-affine ``mode``) quantizes it. ``tokenizer_dir`` reuses an already trained tokenizer
    (the tests train one per session). The directory is written atomically.
    """
    from mlx_lm.utils import save_config, save_model

    from ..core.writer import output as reserve

    config = tiny_config(model_type, vocab_size=vocab_size, **overrides)
    model = build_model(config, seed=seed)
    if bits is not None or mode != "affine":
        model, config = quantize(model, config, bits=bits or 4, group_size=group_size, mode=mode)
    out = Path(output)
    with reserve(out, kind="dir", force=True) as res:
        tmp = res.tmp
        save_model(tmp, model, donate_model=True)
        save_config(config, config_path=tmp / "config.json")
        if tokenizer_dir is not None:
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
        else:
            train_tokenizer(tmp, vocab_size=vocab_size)
    return out


def make_tiny_adapter(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, rank: int = 4, scale: float = 20.0,
                      num_layers: int = -1, keys: list[str] | None = None, seed: int = 0) -> Path:
    """A LoRA adapter of the model in ``model_dir``, written to ``out_dir`` as ``mlx_lm.lora`` writes one:
    mlx-lm's ``linear_to_lora_layers`` on the frozen model (the last ``num_layers`` decoder layers, -1 all; ``keys``:
    which layers, default all linear / expert layers), ``adapters.safetensors`` holding the trainable parameters and
    ``adapter_config.json`` its settings. ``lora_b`` starts at zero in mlx-lm (training moves it); here it is drawn
    from ``seed`` (scaled so the adapter changes the routing), standing in for a trained adapter."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(model_dir))
    model.freeze()
    lora = {"rank": rank, "dropout": 0.0, "scale": scale, **({"keys": keys} if keys else {})}
    linear_to_lora_layers(model, num_layers, lora)
    key = mx.random.key(seed)
    params = dict(tree_flatten(model.trainable_parameters()))
    for name in sorted(params):
        key, sub = mx.random.split(key)
        if name.endswith("lora_b"):
            params[name] = 0.05 * mx.random.normal(params[name].shape, key=sub).astype(params[name].dtype)
    model.update(tree_unflatten(list(params.items())))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"model": str(model_dir), "fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": lora}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=4))
    return out
