"""Perplexity of a model on held-out token data and, against a reference model, next-token KL divergence and
top-1 agreement: how much a compression (prune, merge, quantize) changed what the model predicts.

Every sample of ``n`` tokens gives ``n - 1`` scored next-token predictions (position ``t`` predicts token
``t + 1``); samples of fewer than two tokens score nothing and are skipped. Per dataset:

* ``nll``: token-weighted mean negative log-likelihood (nats) of the true next token under the model;
  ``ppl = exp(nll)``.
* with a reference ``R``: ``ref_nll`` / ``ref_ppl`` of the reference on the same tokens, ``kl`` the mean over
  scored positions of ``KL(R ‖ M) = Σ_v p_R(v) (log p_R(v) − log p_M(v))`` in nats, and ``top1_agreement`` the
  fraction of positions where ``argmax p_M == argmax p_R`` (ties broken by the lowest token id, identically for
  both).

How it is computed
    Forwards run on :func:`mlx_fun.model.engine.run` (next-token mode): samples sorted by length and right padded,
    each fed without its last token (it predicts nothing), at most a token budget per forward (long samples in
    chunks with the KV cache; a reference runs in lockstep with its own cache). Causal attention means padding
    never changes a real position, and padded positions are never scored, so results do not depend on the batch
    size (up to float rounding of different matmul shapes). Log-probabilities are ``log_softmax`` in float32 of
    the logits at the scored positions only, taken in chunks of about 16 M logits, and reduced per position (NLL,
    KL, argmax) on the device; the per-position values are summed in float64 on the host. Only one forward's
    logits (of the model and of the reference) are alive at a time, so memory does not grow with the dataset.

``model`` and ``reference`` are anything that maps an ``(B, L)`` int32 ``mx.array`` of token ids to ``(B, L, V)``
logits: an mlx-lm model (float or quantized), a hooked one, or a test double. With a :class:`ReferenceCache`
(the reference's log-probabilities kept in memory, built once) many models can be compared with one reference
without running it again; it costs ``4 · V`` bytes per scored token, so it is meant for small vocabularies and
evaluation sets (the bundled tiny model, benchmarks), and :meth:`ReferenceCache.build` refuses to exceed
``max_bytes``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from ..datasets.samples import DEFAULT_EXTENSIONS, DEFAULT_TEXT_KEY, load_samples
from ..errors import UserError

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "ReferenceCache",
    "check_compatible",
    "config_vocab_size",
    "dataset_name",
    "evaluate",
    "format_results",
    "load_eval_datasets",
    "resolve_datasets",
    "tokenizer_vocab_size",
]

DEFAULT_BATCH_SIZE = 4
#: rows × vocabulary per log-softmax chunk (64 MiB of float32 per temporary)
CHUNK_ELEMENTS = 1 << 24

Model = Callable[[mx.array], mx.array]


# ----------------------------------------------------------------------------------------------------------
# datasets


def dataset_name(path: str | os.PathLike) -> str:
    """The name a dataset is reported under: the file's stem (``test.jsonl`` → ``test``) or the directory name."""
    p = Path(path)
    return p.name if p.is_dir() else p.stem


def resolve_datasets(specs: Sequence[str | os.PathLike]) -> dict[str, Path]:
    """``name → path`` for ``--dataset`` values, checking that every path exists (no file is read).

    A value is a path, or ``NAME=PATH`` to choose the name (used when the value as a whole is not an existing
    path). Otherwise the name is :func:`dataset_name`; when two datasets would get the same name (``code/test.jsonl``
    and ``prose/test.jsonl``), each takes its parent directory's name as a prefix (``code/test``).
    """
    if not specs:
        raise UserError("no dataset given; pass --dataset a JSONL file or a directory (repeat for several)")
    entries: list[tuple[str | None, Path]] = []
    for spec in specs:
        text = os.fspath(spec)
        name: str | None = None
        if "=" in text and not Path(text).exists():
            name, text = text.split("=", 1)
            if not name:
                raise UserError(f"--dataset {spec}: empty name before '='; write NAME=PATH or just PATH")
        path = Path(text)
        if not path.exists():
            raise UserError(f"dataset {path} does not exist; pass --dataset a JSONL file or a directory of text files")
        entries.append((name, path))

    seen: dict[Path, str] = {}
    for name, path in entries:
        key = path.resolve()
        if key in seen:
            raise UserError(f"dataset {path} is given twice; pass each dataset once")
        seen[key] = str(path)

    auto = [dataset_name(p) for _, p in entries]
    explicit = {n for n, _ in entries if n is not None}
    clashes = {n for n in auto if auto.count(n) > 1 or n in explicit}
    out: dict[str, Path] = {}
    for (name, path), default in zip(entries, auto):
        if name is None:
            name = default
            if default in clashes:
                parent = path.resolve().parent.name
                name = f"{parent}/{default}" if parent else str(path)
        if name in out:
            raise UserError(
                f"two datasets are both named '{name}' ({out[name]} and {path}); name them with --dataset NAME=PATH"
            )
        out[name] = path
    return out


def load_eval_datasets(
    specs: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike],
    tokenizer: Any,
    *,
    max_samples: int | None = 128,
    max_tokens: int | None = 2048,
    seed: int | None = 0,
    text_key: str = DEFAULT_TEXT_KEY,
    extensions: Sequence[str] | str = DEFAULT_EXTENSIONS,
) -> dict[str, list[list[int]]]:
    """Tokenize datasets for :func:`evaluate`: ``name → token lists``, in the order given.

    ``specs`` is a list of ``--dataset`` values (see :func:`resolve_datasets`) or a ready ``name → path``
    mapping. Each dataset is read with :func:`mlx_fun.datasets.samples.load_samples` (JSONL in any of its formats, or a
    directory of text files), with its ``max_samples`` / ``max_tokens`` / ``seed`` semantics; the default seed is
    fixed (0) so that two runs on the same data score the same subset. A dataset with no sample of at least two
    tokens (nothing to predict) is a ``UserError``.
    """
    paths = dict(specs) if isinstance(specs, Mapping) else resolve_datasets(specs)
    out: dict[str, list[list[int]]] = {}
    for name, path in paths.items():
        samples = load_samples(
            path, tokenizer, max_samples=max_samples, max_tokens=max_tokens, text_key=text_key, seed=seed,
            extensions=extensions,
        )
        if not any(len(s) >= 2 for s in samples):
            raise UserError(
                f"dataset {path} has no sample of at least 2 tokens, so nothing to predict; "
                f"use longer texts{' or a larger --max-tokens' if max_tokens is not None and max_tokens < 2 else ''}"
            )
        out[str(name)] = samples
    return out


# ----------------------------------------------------------------------------------------------------------
# compatibility


def config_vocab_size(config: Mapping | None) -> int | None:
    """``vocab_size`` of a model config (top level or ``text_config``), or None when it has none."""
    if not config:
        return None
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("vocab_size")
        if isinstance(value, int):
            return value
    return None


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Number of token ids of a (wrapped) Hugging Face tokenizer, added tokens included."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return len(inner)
    except TypeError:
        return len(inner.get_vocab())


def check_compatible(
    model_tokenizer: Any,
    reference_tokenizer: Any,
    model_config: Mapping | None = None,
    reference_config: Mapping | None = None,
    *,
    names: tuple[str, str] = ("--model", "--reference"),
) -> None:
    """Raise ``UserError`` unless model and reference predict over the same token ids.

    Checks the output vocabulary size of the configs (when given), the tokenizers' sizes and their token → id
    maps. Either tokenizer may be None to check the configs only.
    """
    m_cfg, r_cfg = config_vocab_size(model_config), config_vocab_size(reference_config)
    if m_cfg is not None and r_cfg is not None and m_cfg != r_cfg:
        raise UserError(
            f"{names[0]} has a vocabulary of {m_cfg} tokens but {names[1]} has {r_cfg}; "
            f"compare a model only with a reference that uses the same tokenizer"
        )
    if model_tokenizer is None or reference_tokenizer is None:
        return
    m_tok, r_tok = tokenizer_vocab_size(model_tokenizer), tokenizer_vocab_size(reference_tokenizer)
    if m_tok != r_tok:
        raise UserError(
            f"the tokenizer of {names[0]} has {m_tok} tokens but that of {names[1]} has {r_tok}; "
            f"compare a model only with a reference that uses the same tokenizer"
        )
    m_vocab = getattr(model_tokenizer, "get_vocab", None)
    r_vocab = getattr(reference_tokenizer, "get_vocab", None)
    if m_vocab is not None and r_vocab is not None and m_vocab() != r_vocab():
        raise UserError(
            f"the tokenizers of {names[0]} and {names[1]} map tokens to different ids; "
            f"compare a model only with a reference that uses the same tokenizer"
        )


# ----------------------------------------------------------------------------------------------------------
# batching


@dataclass(frozen=True)
class _Batch:
    inputs: np.ndarray  # (B, T) int32: the fed tokens of one forward (each sample without its last token)
    rows: np.ndarray  # (N,) int64: flat indices into (B * T) of the scored positions
    targets: np.ndarray  # (N,) int32: the true next token of each scored position

    @property
    def n(self) -> int:
        return int(self.rows.size)

    @classmethod
    def of(cls, chunk) -> "_Batch":
        b, t = np.nonzero(chunk.valid)
        width = chunk.tokens.shape[1]
        return cls(chunk.tokens, (b * width + t).astype(np.int64), chunk.targets[b, t].astype(np.int32))


def _chunks(n: int, vocab: int) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(1, vocab))
    for start in range(0, n, step):
        yield start, min(n, start + step)


def _log_softmax(logits: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def kl_divergence(ref_logprobs: mx.array, logprobs: mx.array) -> mx.array:
    """Per row ``KL(R ‖ M) = Σ_v p_R(v) (log p_R(v) − log p_M(v))`` in nats from log-probability rows (the one KL of
    ``evaluate`` and ``abliterate``); terms where ``p_R`` underflows to 0 count 0, rounding below 0 is clipped."""
    p = mx.exp(ref_logprobs)
    return mx.maximum(mx.sum(mx.where(p > 0, p * (ref_logprobs - logprobs), 0.0), axis=-1), 0.0)


def _flat_logits(logits, inputs: np.ndarray, what: str) -> mx.array:
    if not isinstance(logits, mx.array) or logits.ndim != 3 or logits.shape[:2] != inputs.shape:
        shape = getattr(logits, "shape", type(logits).__name__)
        raise ValueError(f"the {what} returned {shape} for inputs of shape {inputs.shape}; expected (B, L, V) logits")
    return logits.reshape(-1, logits.shape[-1])


def _run(models, samples, batch_size: int, pad_id: int, budget: int | None, fn, progress: bool, desc: str) -> int:
    """:func:`mlx_fun.model.engine.run` for next-token scoring: ``fn(i, batch, chunk, outputs)`` after the ``i``-th
    forward (``progress``: the engine's bar over the scored tokens). Returns the number of forwards."""
    from ..model import engine

    count = [0]

    def on_chunk(chunk, outputs):
        fn(count[0], _Batch.of(chunk), chunk, outputs)
        count[0] += 1

    engine.run(models, samples, on_chunk, batch_size=batch_size, pad_id=pad_id, budget=budget, predict_next=True,
               progress=progress, desc=desc)
    return count[0]


def _gather(flat: mx.array, batch: _Batch, start: int, stop: int) -> mx.array:
    return mx.take(flat, mx.array(batch.rows[start:stop]), axis=0)


def _nll(logprobs: mx.array, targets: mx.array) -> mx.array:
    return -mx.take_along_axis(logprobs, targets[:, None], axis=-1).squeeze(-1)


def _scored_tokens(samples: Sequence[Sequence[int]]) -> int:
    return int(sum(len(s) - 1 for s in samples if len(s) >= 2))


def _mean(total: float, n: int) -> float:
    return total / n if n else float("nan")


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return float("inf")


# ----------------------------------------------------------------------------------------------------------
# reference cache


@dataclass
class ReferenceCache:
    """The reference's float32 log-probabilities at every scored position of some datasets, kept in memory.

    Build it once with :meth:`build` and pass it as ``reference`` to :func:`evaluate` for each model to compare,
    with the same samples, batch size, pad id and budget (checked: a mismatch is a ``ValueError``). Results equal those
    of passing the reference model itself.
    """

    batch_size: int
    pad_id: int
    vocab: int
    budget: int | None = None  # the token budget per forward it was built with
    #: dataset name → per forward: (fed inputs, [log-prob chunk (rows, V) float32, ...])
    batches: dict[str, list[tuple[np.ndarray, list[mx.array]]]] = field(default_factory=dict)
    #: dataset name → {"tokens", "ref_nll", "ref_ppl"}
    stats: dict[str, dict] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(sum(c.nbytes for batches in self.batches.values() for _, chunks in batches for c in chunks))

    @classmethod
    def build(
        cls,
        reference: Model,
        samples_by_name: Mapping[str, Sequence[Sequence[int]]],
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        pad_id: int = 0,
        budget: int | None = None,
        max_bytes: int = 2 << 30,
        progress: bool = False,
    ) -> "ReferenceCache":
        """Run ``reference`` once over every dataset and keep its log-probabilities.

        Raises ``ValueError`` (before computing anything big) when they would take more than ``max_bytes``
        (``4 · V`` bytes per scored token); pass the reference model to :func:`evaluate` instead then.
        """
        total = sum(_scored_tokens(s) for s in samples_by_name.values())
        cache = cls(batch_size=batch_size, pad_id=pad_id, vocab=0, budget=budget)
        for name, samples in samples_by_name.items():
            entries: list[tuple[np.ndarray, list[mx.array]]] = []
            sums = [0.0]

            def keep(i, batch, chunk, logits, entries=entries, sums=sums):
                flat = _flat_logits(logits, batch.inputs, "reference")
                vocab = int(flat.shape[-1])
                if cache.vocab == 0:
                    need = total * vocab * 4
                    if need > max_bytes:
                        raise ValueError(
                            f"the reference log-probabilities would take {need / 2**20:,.0f} MiB "
                            f"({total:,} tokens × {vocab:,} vocab × 4 B) > max_bytes={max_bytes:,}; "
                            f"pass the reference model to evaluate() instead"
                        )
                    cache.vocab = vocab
                chunks = []
                for start, stop in _chunks(batch.n, vocab):
                    lq = _log_softmax(_gather(flat, batch, start, stop))
                    nll = _nll(lq, mx.array(batch.targets[start:stop]))
                    chunk.eval(lq, nll)
                    chunks.append(lq)
                    sums[0] += float(np.asarray(nll, dtype=np.float64).sum())
                entries.append((batch.inputs, chunks))

            _run(reference, samples, batch_size, pad_id, budget, keep, progress, f"reference {name}")
            count = sum(int(c.shape[0]) for _, chunks in entries for c in chunks)
            cache.batches[name] = entries
            ref_nll = _mean(sums[0], count)
            cache.stats[name] = {"tokens": count, "ref_nll": ref_nll, "ref_ppl": _exp(ref_nll)}
        return cache


# ----------------------------------------------------------------------------------------------------------
# evaluation


def evaluate(
    model: Model,
    samples_by_name: Mapping[str, Sequence[Sequence[int]]],
    reference: Model | ReferenceCache | None = None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    pad_id: int = 0,
    token_budget: int | None = None,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """Score ``model`` on every dataset of ``samples_by_name`` (name → token-id lists), optionally against a
    ``reference`` (a model, or a :class:`ReferenceCache` built with the same samples / batch size / pad id /
    budget).

    Returns, per dataset name (in the given order), a dict with ``samples`` (samples of ≥ 2 tokens),
    ``tokens`` (scored next-token predictions), ``nll`` (mean, nats) and ``ppl``; with a reference also
    ``ref_nll``, ``ref_ppl``, ``kl`` (mean KL(reference ‖ model), nats) and ``top1_agreement`` (fraction). Means
    are NaN for a dataset with nothing to score. ``progress`` shows a tqdm bar (tokens/s) per dataset. Forwards
    run on :func:`mlx_fun.model.engine.run` with at most ``token_budget`` tokens each.
    """
    check_batch_size(batch_size)
    cache = reference if isinstance(reference, ReferenceCache) else None
    if cache is not None and (cache.batch_size, cache.pad_id, cache.budget) != (batch_size, pad_id, token_budget):
        raise ValueError(
            f"the reference cache was built with batch_size={cache.batch_size}, pad_id={cache.pad_id}, "
            f"budget={cache.budget}; evaluate with the same (got batch_size={batch_size}, pad_id={pad_id}, "
            f"budget={token_budget})"
        )
    results: dict[str, dict[str, Any]] = {}
    for name, samples in samples_by_name.items():
        results[name] = _evaluate_one(model, samples, reference, cache, name, batch_size, pad_id, token_budget,
                                      progress)
    return results


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {batch_size}; pass --batch-size 1 or more")


@dataclass
class Sums:
    nll: float = 0.0
    ref_nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    count: int = 0


def _score(flat: mx.array, batch: _Batch, chunk, ref_flat: mx.array | None, ref_chunks, sums: Sums) -> None:
    """Add one forward's NLL (and KL, top-1 agreement, reference NLL) to ``sums``, in vocabulary chunks."""
    vocab = int(flat.shape[-1])
    with_ref = ref_flat is not None or ref_chunks is not None
    for j, (start, stop) in enumerate(_chunks(batch.n, vocab)):
        targets = mx.array(batch.targets[start:stop])
        lp = _log_softmax(_gather(flat, batch, start, stop))
        outs = [_nll(lp, targets)]
        if with_ref:
            lq = ref_chunks[j] if ref_chunks is not None else _log_softmax(_gather(ref_flat, batch, start, stop))
            outs += [kl_divergence(lq, lp), mx.argmax(lq, axis=-1) == mx.argmax(lp, axis=-1)]
            if ref_chunks is None:
                outs.append(_nll(lq, targets))
        chunk.eval(*outs)
        sums.nll += float(np.asarray(outs[0], dtype=np.float64).sum())
        if with_ref:
            sums.kl += float(np.asarray(outs[1], dtype=np.float64).sum())
            sums.agree += int(np.asarray(outs[2]).sum())
            if ref_chunks is None:
                sums.ref_nll += float(np.asarray(outs[3], dtype=np.float64).sum())
    sums.count += batch.n


def score_chunk(logits: mx.array, chunk, sums: Sums, ref_logits: mx.array | None = None) -> None:
    """Add one forward's scores to ``sums``: the model's ``(B, L, V)`` logits of the engine chunk ``chunk``
    (:class:`mlx_fun.model.engine.Chunk` with its targets) and, when given, the reference's."""
    batch = _Batch.of(chunk)
    flat = _flat_logits(logits, batch.inputs, "model")
    ref_flat = None
    if ref_logits is not None:
        ref_flat = _flat_logits(ref_logits, batch.inputs, "reference")
        same_vocab(int(flat.shape[-1]), int(ref_flat.shape[-1]))
    _score(flat, batch, chunk, ref_flat, None, sums)


def same_vocab(vocab: int, ref_vocab: int) -> None:
    if ref_vocab != vocab:
        raise UserError(f"the model predicts {vocab} token ids but the reference {ref_vocab}; "
                        f"compare a model only with a reference that uses the same tokenizer")


def _evaluate_one(model, samples, reference, cache, name, batch_size, pad_id, budget, progress) -> dict[str, Any]:
    with_ref = reference is not None
    cached = None
    if cache is not None:
        if name not in cache.batches:
            raise ValueError(f"the reference cache has no dataset '{name}' (it has: {', '.join(cache.batches)})")
        cached = cache.batches[name]
    two = with_ref and cached is None and reference is not model  # the reference runs beside the model
    sums = Sums()

    def step(i, batch, chunk, outputs):
        flat = _flat_logits(outputs[0] if two else outputs, batch.inputs, "model")
        vocab = int(flat.shape[-1])
        ref_flat = ref_chunks = None
        if cached is not None:
            if i >= len(cached) or not np.array_equal(cached[i][0], batch.inputs):
                raise ValueError(f"dataset '{name}': the samples differ from those the reference cache was built with")
            ref_chunks = cached[i][1]
            same_vocab(vocab, cache.vocab)
        elif with_ref:
            ref_flat = _flat_logits(outputs[1], batch.inputs, "reference") if two else flat
            same_vocab(vocab, int(ref_flat.shape[-1]))
        _score(flat, batch, chunk, ref_flat, ref_chunks, sums)

    n_forwards = _run((model, reference) if two else model, samples, batch_size, pad_id, budget, step, progress,
                      f"eval {name}")
    if cached is not None and n_forwards != len(cached):
        raise ValueError(f"dataset '{name}': the samples differ from those the reference cache was built with")

    return summary(samples, sums, with_ref, ref_nll=cache.stats[name]["ref_nll"] if cache is not None else None)


def summary(samples, sums: Sums, with_ref: bool, *, ref_nll: float | None = None) -> dict[str, Any]:
    """One dataset's result (see :func:`evaluate`) from its sums (``ref_nll``: the cache's, else from ``sums``)."""
    nll = _mean(sums.nll, sums.count)
    out: dict[str, Any] = {
        "samples": sum(1 for s in samples if len(s) >= 2),
        "tokens": sums.count,
        "nll": nll,
        "ppl": _exp(nll),
    }
    if with_ref:
        ref_nll = _mean(sums.ref_nll, sums.count) if ref_nll is None else ref_nll
        out.update(ref_nll=ref_nll, ref_ppl=_exp(ref_nll), kl=_mean(sums.kl, sums.count),
                   top1_agreement=_mean(float(sums.agree), sums.count))
    return out


# ----------------------------------------------------------------------------------------------------------
# presentation


def _fmt_ppl(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3e}" if x >= 1e5 else f"{x:,.2f}"


def _fmt_kl(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.1e}" if 0 < x < 1e-4 else f"{x:.4f}"


def format_results(results: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of :func:`evaluate`'s results: dataset, samples, tokens, ppl, and where present ref ppl,
    KL (nats) and top-1 agreement."""
    with_ref = any("kl" in r for r in results.values())
    header = ["dataset", "samples", "tokens", "ppl"]
    if with_ref:
        header += ["ref ppl", "KL (nats)", "top-1 agree"]
    rows = []
    for name, r in results.items():
        row = [str(name), f"{r['samples']:,}", f"{r['tokens']:,}", _fmt_ppl(r["ppl"])]
        if with_ref:
            if "kl" in r:
                row += [_fmt_ppl(r["ref_ppl"]), _fmt_kl(r["kl"]), f"{100 * r['top1_agreement']:.1f}%"]
            else:
                row += ["-", "-", "-"]
        rows.append(row)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = []
    for line in [header, *rows]:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
