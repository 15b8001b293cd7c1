"""The dashboard's figures (matplotlib, Agg, off-screen): pure functions of arrays, so tests read their cells back.

- :func:`heatmap`       MoE layers × experts of one metric (viridis from 0 to the largest value; colour bar named
                        after the metric)
- :func:`layer_bars`    one layer's experts as bars
- :func:`diff_heatmap`  a signed difference, diverging colours centred on white at 0 (red: file 1 higher)

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


def diff_heatmap(diff, *, metric: str, layer_names: Sequence[int] | None = None,
                 labels: Sequence[str] = ("file 1", "file 2")):
    """A signed (layers, experts) difference: red where file 1 is higher, blue where file 2 is, white at 0."""
    d = _matrix(diff)
    lim = float(np.abs(d).max()) or 1.0
    fig = _figure(*_size(*d.shape))
    ax = fig.add_subplot()
    im = ax.imshow(d, aspect="auto", cmap=DIFF_CMAP, vmin=-lim, vmax=lim, interpolation="nearest")
    fig.colorbar(im, ax=ax, label=f"{label(metric)}: {labels[0]} − {labels[1]}")
    ax.set_xlabel("Expert")
    ax.set_ylabel("Layer")
    ax.set_title(f"{label(metric)} difference (red: {labels[0]} higher, blue: {labels[1]} higher)")
    _ticks(ax, d.shape[0], d.shape[1], layer_names)
    return fig


def cell_pixel(fig, row: int, col: int) -> tuple[int, int]:
    """``(x, y)`` pixel of cell (row, col)'s centre in the PNG ``fig.savefig`` writes (as the page shows it):
    how tests read a rendered heatmap's cells back."""
    fig.canvas.draw()
    ax = fig.axes[0]
    x, y = ax.transData.transform((col, row))
    height = fig.canvas.get_width_height()[1]
    return int(round(x)), int(round(height - y))
