"""The one forward engine: token batches through a model, for every command that runs data through one.

``run(model, samples, on_chunk, ...)`` batches samples by length (right-padded; :func:`mlx_fun.datasets.samples.iter_batch_rows`)
and keeps every forward within a **token budget** (rows × columns per forward): a batch whose padded size is over
the budget is split into fewer rows, and a sample longer than the budget is fed in chunks of ``budget`` tokens
with mlx-lm's KV cache (``make_prompt_cache``, exactly how ``mlx_lm.generate`` prefills a long prompt), so no batch
size or sample length can exhaust memory or reach a size a backend cannot launch. For each forward it calls
``on_chunk(chunk, output)`` with the lazy model output; the consumer evaluates what it needs through
``chunk.eval(...)``, which evaluates the KV cache along with it (one graph per forward).

Consumers: :func:`mlx_fun.observe.collect.collect` (hooked MoE taps; the output itself is never evaluated) and
:func:`mlx_fun.observe.evaluate.evaluate` (``predict_next=True``: each sample is fed without its last token and
``chunk.targets`` holds the next token of every fed position). With the default budget and the usual batch sizes
nothing is split, and results are those of one forward per batch; a forced small budget gives the same statistics
up to float rounding of the attention over the cache (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..datasets.samples import iter_batch_rows
from ..errors import UserError

#: tokens (rows × columns) per forward unless the caller says otherwise: large enough that the usual batch sizes
#: run in one forward per batch, small enough to bound activations (8 k tokens × hidden 7168 × 4 B ≈ 235 MB per
#: activation of a DeepSeek-V3-size model)
DEFAULT_TOKEN_BUDGET = 8192


@dataclass
class Chunk:
    """One forward: ``tokens`` (B, T) fed, starting at position ``start`` of the samples ``rows`` (B,)."""

    tokens: np.ndarray
    lengths: np.ndarray  # (B,) fed tokens of each whole sample (padding excluded)
    start: int
    rows: np.ndarray
    caches: list | None = None  # one KV cache (a list of layer caches) per model, when the sample is chunked
    targets: np.ndarray | None = None  # (B, T) next token of each fed position (predict_next)

    @property
    def valid(self) -> np.ndarray:
        """(B, T) True where a real (not padding) token was fed."""
        return (self.start + np.arange(self.tokens.shape[1]))[None, :] < self.lengths[:, None]

    @property
    def n_tokens(self) -> int:
        return int(self.valid.sum())

    def eval(self, *arrays) -> None:
        """Evaluate ``arrays`` together with this forward's KV cache (needed by the next chunk of the sample)."""
        state = [c.state for cache in self.caches for c in cache] if self.caches is not None else []
        mx.eval(list(arrays), state)


def token_budget(requested: int | None = None) -> int:
    budget = DEFAULT_TOKEN_BUDGET if requested is None else int(requested)
    if budget < 1:
        raise UserError(f"the token budget per forward must be at least 1, got {budget}.")
    return budget


def total_tokens(samples: Sequence[Sequence[int]], predict_next: bool = False) -> int:
    drop = 1 if predict_next else 0
    return int(sum(max(0, len(s) - drop) for s in samples))


def run(
    model,
    samples: Sequence[Sequence[int]],
    on_chunk: Callable[[Chunk, object], None],
    *,
    batch_size: int = 1,
    pad_id: int = 0,
    budget: int | None = None,
    predict_next: bool = False,
    progress: bool = False,
    desc: str = "forward",
    progress_scale: float = 1.0,
) -> int:
    """Feed ``samples`` (token-id lists) through ``model`` within ``budget`` tokens per forward; call
    ``on_chunk(chunk, output)`` after each forward. Returns the number of real tokens fed. ``progress`` shows a
    tqdm bar in tok/s. With ``predict_next`` each sample is fed without its last token (samples shorter than 2
    tokens are skipped) and ``chunk.targets`` holds the next tokens. ``model`` may be a tuple of models fed in
    lockstep (a model and its reference, each with its own KV cache); ``output`` is then the tuple of outputs.
    ``progress_scale`` multiplies the bar's tokens (data-parallel collect: rank 0's bar shows all ranks' work)."""
    from mlx_lm.models.cache import make_prompt_cache

    budget = token_budget(budget)
    models = model if isinstance(model, tuple) else (model,)
    if predict_next:
        full = [np.asarray(s, dtype=np.int64).reshape(-1) for s in samples if len(s) >= 2]
        fed = [s[:-1] for s in full]
    else:
        full, fed = None, samples
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=round(total_tokens(fed) * progress_scale), unit="tok", unit_scale=True, desc=desc,
                   dynamic_ncols=True)
    done = 0
    try:
        for sub, sub_len, rows in batches(fed, batch_size, pad_id=pad_id, budget=budget):
            width = min(sub.shape[1], budget)
            targets = next_tokens(full, rows, sub.shape, pad_id) if full is not None else None
            caches = [make_prompt_cache(m) for m in models] if sub.shape[1] > width else None
            for s0 in range(0, sub.shape[1], width):
                x = mx.array(sub[:, s0:s0 + width])
                outs = tuple(m(x, cache=caches[j]) if caches else m(x) for j, m in enumerate(models))
                chunk = Chunk(sub[:, s0:s0 + width], sub_len, s0, rows, caches,
                              None if targets is None else targets[:, s0:s0 + width])
                on_chunk(chunk, outs if isinstance(model, tuple) else outs[0])
                n = chunk.n_tokens
                done += n
                if bar is not None:
                    bar.update(min(round(n * progress_scale), bar.total - bar.n))
    finally:
        if bar is not None:
            bar.close()
    return done


def batches(samples: Sequence[Sequence[int]], batch_size: int, *, pad_id: int = 0, budget: int | None = None):
    """Length-bucketed batches split by rows to the budget: ``(tokens, lengths, rows)`` with
    ``rows · min(columns, budget) <= budget`` (one row may still be longer than the budget: :func:`run` feeds it in
    chunks)."""
    budget = token_budget(budget)
    for tokens, lengths, rows in iter_batch_rows(samples, batch_size, pad_id=pad_id):
        per = max(1, budget // min(tokens.shape[1], budget))
        for r0 in range(0, len(rows), per):
            sub_len = lengths[r0:r0 + per]
            yield tokens[r0:r0 + per, : int(sub_len.max())], sub_len, rows[r0:r0 + per]  # rows: longest first


def budget_for(requested: int | None, *, top_k: int | None = None, dispatched: bool = True) -> int:
    """The token budget, lowered where the backend cannot launch a grouped matmul of ``tokens × top_k`` rows and
    mlx-fun's dispatch (which splits such calls itself) is not installed: CUDA's 65,535 (``dispatch.MAX_ROWS``)."""
    from ..dispatch.experts import MAX_ROWS, backend_name

    budget = token_budget(requested)
    limit = None if dispatched else MAX_ROWS.get(backend_name())
    if limit and top_k:
        budget = min(budget, max(1, limit // top_k))
    return budget


def next_tokens(full: list[np.ndarray], rows: np.ndarray, shape: tuple[int, int], pad_id: int) -> np.ndarray:
    """(B, T) the next token of each fed position of the samples ``full[rows]`` (``pad_id`` past their ends)."""
    out = np.full(shape, pad_id, dtype=np.int32)
    for r, i in enumerate(rows):
        nxt = full[i][1:]
        out[r, : nxt.size] = nxt
    return out
