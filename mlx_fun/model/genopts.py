"""mlx-lm's own generation options where mlx-fun generates (smoke-test, steer): its quantized and rotating KV caches
and speculative decoding with a draft model, checked once, in one line naming the option, before anything loads.

They are passed straight to ``mlx_lm.generate.stream_generate`` (``kv_bits`` / ``kv_group_size`` /
``quantized_kv_start``: mlx-lm's ``QuantizedKVCache`` from that many tokens on; ``max_kv_size``: its
``RotatingKVCache``; ``draft_model`` / ``num_draft_tokens``: ``speculative_generate_step``), so mlx-fun's generation is
never less than ``mlx_lm.generate``'s. Combinations mlx-lm does not run are refused instead of ignored: a rotating
cache cannot be quantized (mlx-lm: "RotatingKVCache Quantization NYI"), and speculative decoding drops
``max_kv_size`` silently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import click

from ..core.options import Group, Opt, option
from ..core.ranges import (DRAFT_TOKENS, MIN_P, MIN_TOKENS_TO_KEEP, SEED, TEMPERATURE, TOP_K, TOP_P, XTC_PROBABILITY,
                           XTC_THRESHOLD)
from ..errors import UserError, param

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
KV_GROUP_SIZES = (32, 64, 128)
#: ``draft_model`` of the generating jobs (smoke-test, steer, serve): a path or repo id, resolved by ``@job``
DRAFT_MODEL = Opt("A smaller model with the same tokenizer for speculative decoding (mlx-lm's; a directory or a repo "
                  "id). Greedy output is unchanged; --temp > 0 samples as mlx-lm does then.",
                  missing="pass a local mlx-lm model directory or a Hugging Face repo id")


@dataclass(frozen=True)
class GenOptions(Group):
    """mlx-lm's KV-cache and speculative-decoding options, as ``mlx_lm.generate`` names them (``draft_model`` itself
    is the job's parameter: a model it resolves and loads). Built, each field is checked against its option and
    :meth:`validate`; :meth:`check` adds what needs the backend or the draft model."""

    kv_bits: int | None = option(
        None, "Quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache).", type=click.Choice(KV_BITS),
        default_text="float")
    kv_group_size: int = option(64, "Group size of the quantized KV cache.", type=click.Choice(KV_GROUP_SIZES))
    quantized_kv_start: int = option(
        5000, "With --kv-bits: quantize the cache once it holds this many tokens (0: from the start).",
        type=click.IntRange(min=0))
    max_kv_size: int | None = option(
        None, "Keep at most this many tokens in the KV cache (mlx-lm's rotating cache; not with --kv-bits or "
        "--draft-model).", type=click.IntRange(min=1))
    num_draft_tokens: int = option(3, "Tokens the draft model proposes per step.", type=DRAFT_TOKENS)

    def validate(self) -> None:
        if self.kv_bits is not None and self.max_kv_size is not None:
            raise UserError(f"{param('kv_bits')} and {param('max_kv_size')} do not go together: mlx-lm cannot "
                            f"quantize its rotating KV cache; pass one of them.")

    def check(self, *, draft: str | Path | None) -> "GenOptions":
        """What a built GenOptions cannot know alone: whether the backend runs mlx-lm's quantized KV attention, and
        that a ``draft`` model (whose path ``@job`` checked) does not go with ``max_kv_size``; one line naming the
        option."""
        if self.kv_bits is not None and (problem := kv_quantization_problem(self.kv_bits, self.kv_group_size)):
            raise UserError(f"{param('kv_bits')} {self.kv_bits} cannot run on this backend: mlx-lm's quantized KV "
                            f"attention fails here ({problem}); drop {param('kv_bits')} (or use {param('max_kv_size')} "
                            f"to bound the cache).")
        if draft and self.max_kv_size is not None:
            raise UserError(f"{param('max_kv_size')} does not work with {param('draft_model')}: mlx-lm's speculative "
                            f"decoding keeps the whole KV cache; drop one of them.")
        return self

    def stream_kwargs(self, draft_model=None) -> dict:
        """Keyword arguments for ``mlx_lm.generate.stream_generate``."""
        kw = asdict(self)
        if draft_model is None:
            kw.pop("num_draft_tokens")
        else:
            kw.pop("max_kv_size")
            kw["draft_model"] = draft_model
        if kw.get("max_kv_size") is None:
            kw.pop("max_kv_size", None)
        return kw


#: ``max_tokens`` and ``chat`` of the generating jobs (smoke-test, steer), declared once (``-m``: mlx-lm's)
MAX_NEW_TOKENS = Opt("Generate at most this many tokens (fewer when the model emits an EOS token).",
                     type=click.IntRange(min=1), aliases=("-m",))
#: ``trust_remote_code`` of the generating commands (smoke-test, serve): mlx-lm's
TRUST_REMOTE_CODE = Opt("Let the tokenizer (and a config's model_file) run the model's own Python code, as mlx-lm's "
                        "--trust-remote-code; only for a model you trust.")
CHAT = Opt("Wrap the prompt in the tokenizer's chat template (one user turn + the generation prompt).")


@dataclass(frozen=True)
class Sampling(Group):
    """How tokens are drawn (the option group ``sampling`` of smoke-test and steer; fields = their options, with
    ``mlx_lm.generate``'s names, defaults and meanings; ranges from :mod:`mlx_fun.core.ranges`, which the server's
    request checks share); :func:`mlx_fun.model.sampling.sampler_of` makes its sampler. At ``temp`` 0 decoding is
    greedy and no mask applies, as in mlx-lm."""

    temp: float = option(0.0, "Sampling temperature; 0 is greedy (exact argmax, identical to mlx_lm.generate's "
                         "default).", type=TEMPERATURE)
    seed: int | None = option(None, "Seed: step n of the generation draws its noise from mx.random.key(seed + n), so "
                              "the same seed reproduces the output. Without it the noise comes from MLX's global RNG.",
                              type=SEED)
    top_k: int = option(0, "Sample only among the k most likely tokens (0 disables).", type=TOP_K)
    top_p: float = option(1.0, "Sample only from the nucleus of the model's (untempered) distribution holding this "
                          "much probability (1 disables).", type=TOP_P)
    min_p: float = option(0.0, "Sample only among the tokens at least this fraction as probable as the most probable "
                          "one (0 disables).", type=MIN_P)
    min_tokens_to_keep: int = option(1, "Tokens --min-p always keeps (the most probable).", type=MIN_TOKENS_TO_KEEP)
    xtc_probability: float = option(0.0, "XTC (exclude top choices): the chance, per token, of dropping every token "
                                    "more probable than --xtc-threshold but the least probable of them (0 disables).",
                                    type=XTC_PROBABILITY)
    xtc_threshold: float = option(0.1, "XTC: the probability above which a token counts as a top choice.",
                                  type=XTC_THRESHOLD)


def kv_quantization_problem(bits: int, group_size: int) -> str | None:
    """Why mlx-lm's quantized KV attention cannot run on the default device (None when it can): its
    ``quantized_scaled_dot_product_attention`` on a few grouped-query tokens. MLX 0.32's CUDA backend has no
    quantized matmul for that layout (``[quantized_matmul] No implementation for problem shape``), so a generation
    with ``kv_bits`` would die at its first token past ``quantized_kv_start``."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    # the layouts MLX 0.32.4's CUDA backend was seen to refuse (head dims 64 / 128, float32 / bfloat16, a few and
    # many cached tokens); each is a few kilobytes
    for dim, dtype, cached in ((64, mx.float32, 9), (128, mx.bfloat16, 1025), (128, mx.float16, 33)):
        try:
            q = mx.quantize(mx.ones((1, 2, cached, dim), dtype=dtype), group_size=group_size, bits=bits)
            mx.eval(quantized_scaled_dot_product_attention(mx.ones((1, 4, 1, dim), dtype=dtype), q, q,
                                                           scale=dim ** -0.5, mask=None, group_size=group_size,
                                                           bits=bits))
        except (RuntimeError, ValueError) as e:
            if "divisible by the quantization group size" in str(e):
                continue  # a head dim this group size cannot take: not a backend limit
            return " ".join(str(e).split())[:160]
    return None


def load_draft(path: str | Path | None, tokenizer):
    """The draft model for speculative decoding (None without one); its vocabulary must be the main model's."""
    if path is None:
        return None
    from .io import load_model

    draft, draft_tokenizer, _config = load_model(path, flag=param("draft_model"))
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise UserError(f"{param('draft_model')} {path} has a vocabulary of {draft_tokenizer.vocab_size:,} tokens and "
                        f"the model {tokenizer.vocab_size:,}: speculative decoding needs the same tokenizer; pass a "
                        f"smaller model of the same family.")
    return draft
