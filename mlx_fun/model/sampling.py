"""Gumbel-max token sampling in MLX, and generation with mlx-lm's KV cache.

Sampling from ``softmax(logits / T)`` is the same as ::

    token = argmax(logits / T + g),   g = -log(-log(u)),   u ~ Uniform(0, 1) i.i.d. per logit

(the Gumbel-max trick), so a sample costs one uniform draw, two logs and an argmax, with no softmax, cumsum or
host round trip.

Randomness
    * seeded: ``u`` comes from ``mx.random.key(seed + step)``; the caller advances ``step`` once per decode step
      (:class:`GumbelSampler` does it for you), so a generation is reproducible from ``seed`` while every step
      draws fresh, independent noise. Reusing one key for every step would correlate the noise across steps.
    * unseeded (``key=None``): ``u`` comes from MLX's global key sequence (``mx.random.seed`` controls it).
    * ``u`` is clipped to ``[tiny, 1 - 2**-24]`` (float32), so ``g`` is always finite.
    * A ``(B, V)`` batch draws one ``(B, V)`` uniform array from the key, so every row gets independent noise.

Temperature
    ``temperature`` is an argument of every call, passed to the noise function as an array. Changing it never
    re-traces or recompiles anything (on the GPU, where the function is ``mx.compile``-d, the compiled graph
    takes ``logits``, ``temperature`` and ``key`` as inputs). ``T = 0`` is exact ``argmax(logits)``: a Python
    ``0`` skips the noise altogether; a ``0`` held in an array is selected inside the graph.

Masks (applied before the noise; masked logits become ``-inf`` and are never sampled)
    * ``top_k``: keep the ``k`` largest logits (0, or ``k >= V``, disables).
    * ``top_p``: keep the smallest set of most probable tokens whose probability under ``softmax(logits)`` (the
      untempered distribution, as in mlx-lm's ``make_sampler``) reaches ``top_p``; ties at the threshold are
      kept (1.0 disables).
    * ``min_p``: keep the tokens at least ``min_p`` times as probable as the most probable one, and at least the
      ``min_tokens_to_keep`` most probable (0 disables; mlx-lm's ``apply_min_p``).
    * XTC (``xtc_probability`` > 0): with that probability per step, drop every token more probable than
      ``xtc_threshold`` but the least probable of them, never the ``xtc_special_tokens`` (mlx-lm passes "\\n" and
      the EOS tokens); the step's coin is drawn from its own key (split from the step's key when seeded).
    They apply in mlx-lm's order (top-p, min-p, XTC, top-k), each on what the one before kept, so with top-p,
    min-p and top-k alone the kept set is their intersection.

Compilation
    ``compiled=None`` (the default) compiles the noise+argmax function only when MLX's default device is a GPU.
    On the CPU backend, MLX's built-in (vectorised) ``log`` / ``uniform`` kernels beat the JIT-fused elementwise
    kernel that ``mx.compile`` generates (measured with ``scripts/benchmarks/bench_sampling.py``), so the plain graph
    is used.

:class:`GumbelSampler` is a drop-in mlx-lm ``sampler`` (``logprobs (B, V) -> tokens (B,)``) with a step
counter: ``mlx_lm.generate.generate_step(prompt, model, sampler=GumbelSampler(temperature=0.8, seed=0))``.
:func:`generate_tokens` / :func:`run_generation` drive ``mlx_lm.generate.stream_generate`` with it (the
``mlx-fun smoke-test`` command is a thin wrapper over :func:`run_generation`).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..errors import UserError, param
from .genopts import Sampling

#: smallest positive normal float32: the lower clip of ``u`` (``-log(tiny)`` ≈ 87.3, so ``g`` ≥ -4.47).
U_MIN = float(np.finfo(np.float32).tiny)
#: largest float32 below 1: the upper clip of ``u`` (``g`` ≤ ≈ 16.6, as with MLX's own ``uniform``).
U_MAX = float(np.nextafter(np.float32(1.0), np.float32(0.0)))

_MASK = -float("inf")


# --------------------------------------------------------------------------------------------------- keys / noise


def seed_key(seed: int, step: int = 0) -> mx.array:
    """The key of decode step ``step`` of a generation seeded with ``seed``: ``mx.random.key(seed + step)`` (modulo
    2**64: a seed near the largest, 2**64 - 1, goes on from 0 as a uint64 does)."""
    seed, step = int(seed), int(step)
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be non-negative integers, got seed={seed}, step={step}")
    return mx.random.key((seed + step) % 2**64)


def keys_for_seeds(seeds: Sequence[int] | np.ndarray) -> mx.array:
    """``(N, 2)`` uint32 keys whose row ``i`` equals ``mx.random.key(seeds[i])``, built without a Python loop.

    For drawing many independently keyed samples at once, e.g.
    ``mx.vmap(lambda k: gumbel_argmax(logits, 1.0, k))(keys_for_seeds(range(20_000)))``.
    """
    s = np.asarray(seeds, dtype=np.uint64).reshape(-1)
    hi = (s >> np.uint64(32)).astype(np.uint32)
    lo = (s & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return mx.array(np.stack([hi, lo], axis=-1))


def clipped_uniform(shape: Sequence[int], key: mx.array | None = None) -> mx.array:
    """float32 ``u`` uniform on ``[U_MIN, U_MAX]`` ⊂ (0, 1) from ``key`` (or MLX's global key sequence)."""
    u = mx.random.uniform(shape=tuple(shape), dtype=mx.float32, key=key)
    return mx.clip(u, U_MIN, U_MAX)


def gumbel_noise(shape: Sequence[int], key: mx.array | None = None) -> mx.array:
    """Finite standard Gumbel noise ``g = -log(-log(u))`` (float32)."""
    return -mx.log(-mx.log(clipped_uniform(shape, key)))


# --------------------------------------------------------------------------------------------------------- masks


def top_k_mask(logits: mx.array, top_k: int) -> mx.array:
    """``logits`` with all but the ``top_k`` largest entries of the last axis set to ``-inf``."""
    vocab = logits.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return logits
    drop = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logits, drop, mx.array(_MASK, logits.dtype), axis=-1)


def top_p_mask(logits: mx.array, top_p: float) -> mx.array:
    """``logits`` with the tokens outside the ``top_p`` nucleus of ``softmax(logits)`` set to ``-inf``.

    The nucleus is the smallest set of most probable tokens whose total probability reaches ``top_p``; tokens
    tied with the least probable kept one are kept too.
    """
    if top_p >= 1.0:
        return logits
    x = logits.astype(mx.float32)
    sorted_x = mx.sort(x, axis=-1)  # ascending
    probs = mx.exp(sorted_x - sorted_x[..., -1:])  # unnormalised; the scale cancels below
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    num_dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_x, num_dropped, axis=-1)
    return mx.where(x < threshold, mx.array(_MASK, logits.dtype), logits)


def min_p_mask(logits: mx.array, min_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    """``logits`` with the tokens less than ``min_p`` times as probable as the most probable one set to ``-inf``,
    the ``min_tokens_to_keep`` most probable always kept (mlx-lm's ``apply_min_p``)."""
    if min_p <= 0.0:
        return logits
    drop = logits < mx.max(logits, axis=-1, keepdims=True) + math.log(min_p)
    if min_tokens_to_keep > 1:
        top = mx.argpartition(logits, kth=-min_tokens_to_keep, axis=-1)[..., -min_tokens_to_keep:]
        drop = mx.put_along_axis(drop, top, mx.array(False), axis=-1)
    return mx.where(drop, mx.array(_MASK, logits.dtype), logits)


@dataclass(frozen=True)
class Xtc:
    """XTC ("exclude top choices") of one step: ``probability`` of applying it, ``threshold``, and the tokens it
    never drops (``special``)."""

    probability: float
    threshold: float = 0.1
    special: tuple[int, ...] = ()


def xtc_mask(logits: mx.array, xtc: Xtc, key: mx.array | None = None) -> mx.array:
    """mlx-lm's ``apply_xtc``: with probability ``xtc.probability`` (a coin from ``key``, else MLX's global key
    sequence) every token more probable than ``xtc.threshold`` but the least probable of them is set to ``-inf``."""
    if xtc.probability <= 0.0:
        return logits
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    mask = probs > mx.where(probs > xtc.threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    if xtc.special:
        mask[..., list(xtc.special)] = False
    coin = mx.random.uniform(shape=(), key=key)
    return mx.where(coin > xtc.probability, logits, mx.where(mask, mx.array(_MASK, logits.dtype), logits))


def mask_logits(logits: mx.array, top_k: int = 0, top_p: float = 1.0, *, min_p: float = 0.0,
                min_tokens_to_keep: int = 1, xtc: Xtc | None = None, xtc_key: mx.array | None = None) -> mx.array:
    """Apply the masks in mlx-lm's order: ``top_p``, ``min_p``, ``xtc`` (its coin from ``xtc_key``), ``top_k``;
    each a no-op when disabled."""
    _check_masks(top_k, top_p, min_p, min_tokens_to_keep, xtc)
    if 0.0 < top_p < 1.0:
        logits = top_p_mask(logits, top_p)
    if min_p > 0.0:
        logits = min_p_mask(logits, min_p, min_tokens_to_keep)
    if xtc is not None and xtc.probability > 0.0:
        logits = xtc_mask(logits, xtc, xtc_key)
    if top_k > 0:
        logits = top_k_mask(logits, top_k)
    return logits


def _check_masks(top_k: int, top_p: float, min_p: float = 0.0, min_tokens_to_keep: int = 1,
                 xtc: Xtc | None = None) -> None:
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0 disables), got {top_k!r}")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 disables), got {top_p!r}")
    if not 0.0 <= float(min_p) <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 disables), got {min_p!r}")
    if not isinstance(min_tokens_to_keep, (int, np.integer)) or min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be a positive integer, got {min_tokens_to_keep!r}")
    if xtc is not None and not (0.0 <= xtc.probability <= 1.0 and 0.0 <= xtc.threshold <= 0.5):
        raise ValueError(f"xtc probability must be in [0, 1] and threshold in [0, 0.5], got {xtc!r}")


# -------------------------------------------------------------------------------------------- the Gumbel argmax


def _scores(logits: mx.array, temperature: mx.array, g: mx.array, maybe_zero: bool) -> mx.array:
    scores = logits / temperature + g
    # T == 0 inside the graph: select the plain logits (the inf/nan of logits / 0 is discarded).
    return mx.where(temperature > 0, scores, logits) if maybe_zero else scores


def _make_argmax(keyed: bool, maybe_zero: bool, compiled: bool):
    if keyed:

        def fn(logits, temperature, key):
            return mx.argmax(_scores(logits, temperature, gumbel_noise(logits.shape, key), maybe_zero), axis=-1)

        return mx.compile(fn) if compiled else fn

    def fn(logits, temperature):
        return mx.argmax(_scores(logits, temperature, gumbel_noise(logits.shape), maybe_zero), axis=-1)

    # the unseeded graph threads MLX's global random state through the compiled function (as mlx-lm does)
    return partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)(fn) if compiled else fn


# (keyed, maybe_zero, compiled) -> function. Temperature and key are inputs of every variant, so new values
# reuse the traced / compiled graph; ``maybe_zero`` is the variant for a temperature held in an array.
_ARGMAX = {(k, z, c): _make_argmax(k, z, c) for k in (True, False) for z in (True, False) for c in (True, False)}


def default_compiled() -> bool:
    """Compile the noise+argmax graph? Only on a GPU (see the module docstring for the CPU measurement)."""
    return mx.default_device().type == mx.DeviceType.gpu


def gumbel_argmax(
    logits: mx.array,
    temperature: float | mx.array,
    key: mx.array | None = None,
    compiled: bool | None = None,
) -> mx.array:
    """``argmax(logits / T + g)`` over the last axis; ``(V,) -> ()``, ``(B, V) -> (B,)`` (uint32).

    ``temperature`` may be a Python number or an MLX scalar array; ``T == 0`` gives ``argmax(logits)`` exactly.
    ``key`` = ``None`` draws from MLX's global key sequence. No masking here (see :func:`sample`).
    """
    maybe_zero = isinstance(temperature, mx.array)
    if not maybe_zero:
        t = float(temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {t}")
        if t == 0.0:
            return mx.argmax(logits, axis=-1)
        temperature = mx.array(t, dtype=mx.float32)
    if compiled is None:
        compiled = default_compiled()
    fn = _ARGMAX[(key is not None, maybe_zero, bool(compiled))]
    return fn(logits, temperature) if key is None else fn(logits, temperature, key)


def sample(
    logits: mx.array,
    temperature: float | mx.array = 1.0,
    key: mx.array | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    compiled: bool | None = None,
    *,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    xtc: Xtc | None = None,
) -> mx.array:
    """One token per row of ``logits`` from ``softmax(logits / T)`` restricted to what the masks keep
    (:func:`mask_logits`; with ``xtc`` and a ``key``, the key is split: one half draws the noise, the other XTC's
    coin).

    ``logits`` may be raw logits or log-probabilities (``(V,)`` or ``(B, V)``); the result is ``()`` or ``(B,)``.
    """
    if isinstance(temperature, (int, float)) and temperature == 0:
        _check_masks(top_k, top_p, min_p, min_tokens_to_keep, xtc)
        return mx.argmax(logits, axis=-1)  # greedy, as mlx-lm's make_sampler(temp=0): no mask applies
    xtc_key = None
    if xtc is not None and xtc.probability > 0.0 and key is not None:
        key, xtc_key = mx.random.split(key)
    masked = mask_logits(logits, top_k, top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep, xtc=xtc,
                         xtc_key=xtc_key)
    return gumbel_argmax(masked, temperature, key, compiled)


class GumbelSampler:
    """An mlx-lm ``sampler``: ``sampler(logprobs (B, V)) -> tokens (B,)``, one decode step per call.

    Seeded (``seed`` given), call ``n`` (counting from ``step``, default 0) uses ``mx.random.key(seed + n)``:
    the same seed reproduces a generation; each step gets fresh noise. Unseeded, noise comes from MLX's global
    key sequence. ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``min_tokens_to_keep`` and ``xtc`` (an
    :class:`Xtc` or None) are plain attributes and may be changed between calls (no recompilation);
    ``temperature=0`` is greedy (exact argmax). ``reset()`` rewinds the step counter.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        seed: int | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        step: int = 0,
        compiled: bool | None = None,
        *,
        min_p: float = 0.0,
        min_tokens_to_keep: int = 1,
        xtc: Xtc | None = None,
    ):
        if not math.isfinite(float(temperature)) or float(temperature) < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        _check_masks(top_k, top_p, min_p, min_tokens_to_keep, xtc)
        if seed is not None and int(seed) < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        self.temperature = float(temperature)
        self.seed = None if seed is None else int(seed)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.min_tokens_to_keep = int(min_tokens_to_keep)
        self.xtc = xtc if xtc is not None and xtc.probability > 0 else None
        self.step = int(step)
        self.compiled = compiled

    def key(self, step: int | None = None) -> mx.array | None:
        """The key of ``step`` (default: the next call's); ``None`` when unseeded."""
        if self.seed is None:
            return None
        return seed_key(self.seed, self.step if step is None else step)

    def reset(self, step: int = 0) -> None:
        self.step = int(step)

    def __call__(self, logits: mx.array, temperature: float | mx.array | None = None) -> mx.array:
        t = self.temperature if temperature is None else temperature
        key = self.key() if not (isinstance(t, (int, float)) and t == 0) else None
        self.step += 1
        return sample(logits, t, key, self.top_k, self.top_p, self.compiled, min_p=self.min_p,
                      min_tokens_to_keep=self.min_tokens_to_keep, xtc=self.xtc)

    def __repr__(self) -> str:
        if self.temperature == 0:
            return "GumbelSampler(greedy)"
        parts = [f"T={self.temperature:g}", f"seed={self.seed}" if self.seed is not None else "unseeded"]
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        if self.min_p > 0:
            parts.append(f"min_p={self.min_p:g}" + (f"/{self.min_tokens_to_keep}" if self.min_tokens_to_keep > 1
                                                    else ""))
        if self.xtc is not None:
            parts.append(f"xtc={self.xtc.probability:g}@{self.xtc.threshold:g}")
        return f"GumbelSampler({', '.join(parts)}, step={self.step})"


def make_sampler(temp: float = 0.0, seed: int | None = None, top_k: int = 0, top_p: float = 1.0, *,
                 min_p: float = 0.0, min_tokens_to_keep: int = 1, xtc: Xtc | None = None) -> GumbelSampler:
    """A fresh :class:`GumbelSampler` (step 0); ``temp=0`` is greedy, like ``mlx_lm.sample_utils.make_sampler``."""
    return GumbelSampler(temperature=temp, seed=seed, top_k=top_k, top_p=top_p, min_p=min_p,
                         min_tokens_to_keep=min_tokens_to_keep, xtc=xtc)


def sampler_of(sampling: Sampling, tokenizer=None) -> GumbelSampler:
    """A fresh sampler of ``sampling``'s settings (step 0); XTC never drops what mlx-lm's generate keeps from it,
    ``"\\n"`` and ``tokenizer``'s EOS tokens."""
    xtc = None
    if sampling.xtc_probability > 0:
        special = () if tokenizer is None else (*tokenizer.encode("\n"), *tokenizer.eos_token_ids)
        xtc = Xtc(sampling.xtc_probability, sampling.xtc_threshold, tuple(int(t) for t in special))
    return make_sampler(temp=sampling.temp, seed=sampling.seed, top_k=sampling.top_k, top_p=sampling.top_p,
                        min_p=sampling.min_p, min_tokens_to_keep=sampling.min_tokens_to_keep, xtc=xtc)


# ------------------------------------------------------------------------------------------------- generation


@dataclass
class GenerationResult:
    """What :func:`run_generation` produced. ``tokens`` are the generated ids only (not the prompt)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    finish_reason: str | None = None  # "length" or "stop" (ended on an EOS token, which is the last of ``tokens``)
    draft_tokens: int | None = None  # with a draft model: how many of ``tokens`` it proposed and the model accepted

    @property
    def generation_tokens(self) -> int:
        return len(self.tokens)

    def stats_line(self) -> str:
        draft = "" if self.draft_tokens is None else f" ({self.draft_tokens} accepted from the draft model)"
        return (
            f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:,.1f} tok/s | "
            f"Generation: {self.generation_tokens} tokens, {self.generation_tps:,.1f} tok/s{draft}"
        )


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Prompt token ids: the raw text (a BOS is added when the tokenizer has one, as ``mlx_lm.generate`` does),
    or with ``chat=True`` the tokenizer's chat template around one user message plus the generation prompt."""
    if not chat:
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer has no chat template; drop {param('chat')} to use the raw prompt.")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def run_generation(
    model,
    tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 100,
    sampling: Sampling = Sampling(),
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    options=None,
    draft_model=None,
    prefill_step_size: int | None = None,
) -> GenerationResult:
    """Generate with ``mlx_lm.generate.stream_generate`` (its KV cache, prefill and detokenizer) and our sampler.

    ``prompt`` is text (see :func:`encode_prompt`; ``chat`` applies to text only) or token ids. ``on_text`` receives
    each decoded segment as it is produced. Stops after ``max_tokens`` tokens or on an EOS token (which is then the
    last of ``tokens``). ``options`` (:class:`mlx_fun.model.genopts.GenOptions`) and ``draft_model``: mlx-lm's KV cache
    and speculative decoding options. ``prefill_step_size``: most prompt tokens per forward while prefilling
    (:meth:`mlx_fun.settings.RunSettings.prefill_step`; None: mlx-lm's own step).
    """
    from mlx_lm.generate import stream_generate

    from .genopts import GenOptions

    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ids = encode_prompt(tokenizer, prompt, chat) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise UserError(f"the prompt encodes to no tokens; pass a non-empty {param('prompt')}.")
    sampler = sampler_of(sampling, tokenizer)
    result = GenerationResult(prompt_tokens=len(ids))
    pieces: list[str] = []
    response = None
    kwargs = (options or GenOptions()).stream_kwargs(draft_model)
    if prefill_step_size is not None:
        kwargs["prefill_step_size"] = int(prefill_step_size)
    if draft_model is not None:
        result.draft_tokens = 0
    for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens, sampler=sampler,
                                    **kwargs):
        result.tokens.append(int(response.token))
        if draft_model is not None:
            result.draft_tokens += bool(response.from_draft)
        if response.text:
            pieces.append(response.text)
            if on_text is not None:
                on_text(response.text)
    if response is not None:
        result.prompt_tps = float(response.prompt_tps)
        result.generation_tps = float(response.generation_tps)
        result.finish_reason = response.finish_reason
    result.text = "".join(pieces)
    return result


def generate_tokens(
    model,
    tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 100,
    sampling: Sampling = Sampling(),
    chat: bool = False,
) -> list[int]:
    """The generated token ids of :func:`run_generation` (what ``mlx-fun smoke-test`` prints, as ids)."""
    return run_generation(model, tokenizer, prompt, max_tokens, sampling, chat).tokens


__all__ = [
    "U_MIN",
    "U_MAX",
    "GenerationResult",
    "Sampling",
    "sampler_of",
    "GumbelSampler",
    "clipped_uniform",
    "default_compiled",
    "encode_prompt",
    "generate_tokens",
    "gumbel_argmax",
    "gumbel_noise",
    "keys_for_seeds",
    "make_sampler",
    "mask_logits",
    "min_p_mask",
    "run_generation",
    "sample",
    "seed_key",
    "top_k_mask",
    "top_p_mask",
    "Xtc",
    "xtc_mask",
]
