"""The page: a title line, then the tabs of :data:`mlx_fun.ui.tabs.TABS`, each built by its own module."""

from __future__ import annotations

from pathlib import Path

from .common import Context

CSS = ".mlx-fun-title h1 {margin-bottom: 0} footer {display: none !important}"


def build(ctx: Context):
    """The ``gr.Blocks`` page for ``ctx`` (not launched; :func:`mlx_fun.jobs.ui.start` launches it)."""
    import gradio as gr

    from .tabs import TABS

    with gr.Blocks(title="mlx-fun dashboard", analytics_enabled=False) as page:
        key = " · API key set" if ctx.client.api_key else ""
        gr.Markdown(f"# mlx-fun dashboard\nServer `{ctx.client.url}`{key} · files (Merge, Diff): "
                    f"`{shown_dir(ctx.data_dir)}`", elem_classes="mlx-fun-title")
        for title, module in TABS:
            name = module.__name__.rsplit(".", 1)[-1]
            with gr.Tab(title, id=name, elem_id=f"tab-{name}"):
                module.build(ctx)
    return page


def shown_dir(path: Path) -> str:
    """The data directory as the header shows it: relative to the current directory when inside it."""
    try:
        return Path(path).relative_to(Path.cwd().resolve()).as_posix() or "."
    except ValueError:
        return str(path)
