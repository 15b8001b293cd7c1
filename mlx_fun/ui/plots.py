"""The dashboard's figures (matplotlib, Agg, off-screen): pure functions of arrays, so tests read their cells back.

- :func:`heatmap`       MoE layers × experts of one metric (viridis from 0 to the largest value; colour bar named
                        after the metric)
- :func:`layer_bars`    one layer's experts as bars
- :func:`diff_heatmap`  a signed difference, diverging colours centred on white at 0 (red: file 1 higher), the
                        colour scale clipped at the :data:`CLIP_PERCENTILE` of the absolute difference (one outlier
                        no longer washes the rest out; the title says so)
- :func:`status_heatmap` what happens to each expert (a category per cell: kept, removed, masked, boosted, ...),
                        one colour per category, named on the colour bar: the Merge and Steering tabs

Rows are labelled with decoder-layer indices (what ``--expert-list`` and reports use), columns with expert indices.
Each returns a ``matplotlib.figure.Figure`` (no pyplot state); the page shows it as a PNG.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

METRIC_LABELS = {"freq": "Frequency", "weighted_freq": "Weighted frequency", "reap": "REAP", "ean": "EAN",
                 "rank_sum": "Rank sum (lower = more important)"}
HEAT_CMAP = "viridis"
DIFF_CMAP = "RdBu_r"
#: the percentile of |difference| at which the diff heatmap's colour scale ends
CLIP_PERCENTILE = 99.0


def label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


def _figure(width: float, height: float):
    import matplotlib

    if matplotlib.get_backend().lower() != "agg":
        matplotlib.use("Agg")  # no display, ever (gradio imports pyplot to close figures)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _size(n_rows: int, n_cols: int) -> tuple[float, float]:
    return min(4 + n_cols * 0.18, 16), min(2.2 + n_rows * 0.3, 12)


def _ticks(ax, n_rows: int, n_cols: int, row_names: Sequence[int] | None) -> None:
    ax.set_xticks(range(0, n_cols, max(1, int(np.ceil(n_cols / 32)))))
    rows = list(range(0, n_rows, max(1, int(np.ceil(n_rows / 24)))))
    names = list(row_names) if row_names is not None else list(range(n_rows))
    ax.set_yticks(rows)
    ax.set_yticklabels([str(names[r]) for r in rows])


def _matrix(values) -> np.ndarray:
    m = np.asarray(values, dtype=np.float64)
    if m.ndim != 2 or 0 in m.shape:
        raise ValueError(f"a heatmap needs a non-empty (layers, experts) matrix, got shape {m.shape}")
    return m


def heatmap(scores, *, metric: str, layer_names: Sequence[int] | None = None, title: str | None = None,
            cmap: str = HEAT_CMAP, from_zero: bool = True):
    """(MoE layers, experts) ``scores`` as a heatmap, colours from 0 (``from_zero``; else the smallest value) to the
    largest value; ``layer_names``: the decoder index of each row."""
    s = _matrix(scores)
    lo, hi = (min(0.0, float(s.min())) if from_zero else float(s.min())), float(s.max())
    fig = _figure(*_size(*s.shape))
    ax = fig.add_subplot()
    im = ax.imshow(s, aspect="auto", cmap=cmap, interpolation="nearest", vmin=lo, vmax=hi if hi > lo else lo + 1)
    fig.colorbar(im, ax=ax, label=label(metric))
    ax.set_xlabel("Expert")
    ax.set_ylabel("Layer")
    ax.set_title(title or f"{label(metric)} per layer and expert")
    _ticks(ax, s.shape[0], s.shape[1], layer_names)
    return fig


def layer_bars(row, *, metric: str, layer: int):
    """One layer's experts as bars (expert index on x)."""
    r = np.asarray(row, dtype=np.float64).reshape(-1)
    fig = _figure(_size(1, r.size)[0], 3.2)
    ax = fig.add_subplot()
    ax.bar(np.arange(r.size), r, color="#4c72b0")
    ax.set_xlabel("Expert")
    ax.set_ylabel(label(metric))
    ax.set_title(f"Layer {layer}: {label(metric)} per expert")
    ax.set_xlim(-0.6, r.size - 0.4)
    return fig


def clip_limit(diff, percentile: float = CLIP_PERCENTILE) -> tuple[float, int]:
    """``(limit, cells beyond it)``: the diff heatmap's colour scale runs from −limit to +limit, ``percentile`` of
    the absolute difference (its largest value when that percentile is 0: a mostly equal pair of files)."""
    a = np.abs(_matrix(diff))
    top = float(a.max())
    lim = float(np.percentile(a, percentile))
    lim = lim if lim > 0 else top
    return (lim or 1.0), int((a > lim).sum())


def diff_heatmap(diff, *, metric: str, layer_names: Sequence[int] | None = None,
                 labels: Sequence[str] = ("file 1", "file 2"), percentile: float = CLIP_PERCENTILE):
    """A signed (layers, experts) difference: red where file 1 is higher, blue where file 2 is, white at 0; colours
    end at ± the ``percentile`` of |difference| (:func:`clip_limit`), and the title says how many cells lie beyond."""
    d = _matrix(diff)
    lim, beyond = clip_limit(d, percentile)
    fig = _figure(*_size(*d.shape))
    ax = fig.add_subplot()
    im = ax.imshow(d, aspect="auto", cmap=DIFF_CMAP, vmin=-lim, vmax=lim, interpolation="nearest")
    fig.colorbar(im, ax=ax, label=f"{label(metric)}: {labels[0]} − {labels[1]}")
    ax.set_xlabel("Expert")
    ax.set_ylabel("Layer")
    title = f"{label(metric)} difference (red: {labels[0]} higher, blue: {labels[1]} higher)"
    if beyond:
        title += (f"\ncolours clipped at ±{lim:.4g}, the {percentile:g}th percentile of |difference|: "
                  f"{beyond} cell{'' if beyond == 1 else 's'} beyond it show the end colours")
    ax.set_title(title)
    _ticks(ax, d.shape[0], d.shape[1], layer_names)
    return fig


def status_heatmap(codes, *, categories: Sequence[tuple[str, str]], layer_names: Sequence[int] | None = None,
                   title: str):
    """(MoE layers, experts) ``codes``, each an index into ``categories`` (``(name, colour)``): one flat colour per
    category, the colour bar naming them in order."""
    from matplotlib.colors import BoundaryNorm, ListedColormap

    c = _matrix(codes)
    n = len(categories)
    if not n or c.min() < 0 or c.max() >= n or (c != np.round(c)).any():
        raise ValueError(f"status codes must be whole numbers 0..{n - 1} (one per category), got {c.min()}..{c.max()}")
    cmap = ListedColormap([colour for _name, colour in categories])
    norm = BoundaryNorm(np.arange(-0.5, n), n)
    fig = _figure(*_size(*c.shape))
    ax = fig.add_subplot()
    im = ax.imshow(c, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    bar = fig.colorbar(im, ax=ax, ticks=range(n))
    bar.ax.set_yticklabels([name for name, _colour in categories])
    ax.set_xlabel("Expert")
    ax.set_ylabel("Layer")
    ax.set_title(title)
    _ticks(ax, c.shape[0], c.shape[1], layer_names)
    return fig


def cell_pixel(fig, row: int, col: int) -> tuple[int, int]:
    """``(x, y)`` pixel of cell (row, col)'s centre in the PNG ``fig.savefig`` writes (as the page shows it):
    how tests read a rendered heatmap's cells back."""
    fig.canvas.draw()
    ax = fig.axes[0]
    x, y = ax.transData.transform((col, row))
    height = fig.canvas.get_width_height()[1]
    return int(round(x)), int(round(height - y))
