"""Streamed REAM merging: :func:`mlx_fun.rewrite.merge.merge_model` one decoder layer's weights at a time, each
merged layer written to the checkpoint as it is done (``merge --stream-layers``), resumable after a kill."""

from __future__ import annotations

from ..model.layered import LayerDriver


def run_streamed(driver: LayerDriver, on_layer, checkpoint, maps: dict[str, dict], *, progress: bool, log) -> None:
    """``driver.run(on_layer)`` one decoder layer's weights at a time: once ``on_layer`` has rewritten layer ``i``,
    its tensors (full names, as mlx-lm saves them) are written to ``checkpoint.save_layer``; the driver then pushes
    the hidden states through it and releases it, and the checkpoint saves the hidden states with ``maps`` (merge's
    centroid and group maps, filled by ``on_layer``) and the layer times when it is due (``checkpoint.due()``: every
    layer but where layers are quick beside a save). A checkpoint holding layer ``k`` resumes
    at ``k + 1`` (:func:`mlx_fun.observe.checkpoint.resume`: its hidden states restored, layers ``0..k`` released
    unread), ``maps`` and times refilled."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import get_total_parameters

    from ..observe.checkpoint import carried, resume

    last = driver.adapter.moe_layers()[-1]
    names = {id(m): name for name, m in driver.model.named_modules()}
    start, resumed = resume(checkpoint, driver, layers=last + 1, log=log)
    if resumed is not None:
        for key, values in maps.items():
            values.update(resumed.data[key])
        driver.seconds.update({int(i): s for i, s in resumed.data["layer_seconds"].items()})

    def visit(i: int) -> None:
        on_layer(i)
        layer = driver.layers[i]
        base = names[id(layer)]
        tensors = {f"{base}.{k}" if base else k: v for k, v in tree_flatten(layer.parameters())}
        checkpoint.save_layer(i, tensors, parameters=get_total_parameters(layer))

    def done(i: int) -> None:
        seconds = {str(k): v for k, v in sorted(driver.seconds.items())}
        if checkpoint.due():
            checkpoint.save(i, carried(driver), data={**maps, "layer_seconds": seconds})

    driver.run(visit, last=last, start=start, release=True, on_done=done, progress=progress, desc="merge")

