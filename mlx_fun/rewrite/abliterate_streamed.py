"""``abliterate --stream-layers``: :class:`mlx_fun.rewrite.abliterate_rounds.Abliteration` with one decoder layer's
weights in memory at a time, for a model larger than memory.

The model is loaded lazily and every forward the rounds, measuring and search run is streamed, each decoder layer
read from the model's files (:class:`mlx_fun.model.layer_files.LayerFiles`) for one pass and released after it:

- the residual captures (:func:`mlx_fun.observe.residual.capture_streamed`) and first-token log-probs
  (:func:`mlx_fun.observe.refusal.first_token_logprobs_streamed`): one pass over the layers for all the prompts,
  their hidden states carried by :class:`mlx_fun.model.layered.LayerDriver`;
- the greedy replies: mlx-lm's ``BatchGenerator`` as in memory, each decoder layer loaded when called and released
  once its output and KV cache are evaluated (:func:`mlx_fun.model.layer_files.per_call`): the prompts are
  prefilled layer by layer, every layer's cache kept for all of them, then one pass over the layers per generated
  token — reading every layer again per token is the price, so the greedy replies cost ``reply_tokens`` + 1 passes
  over the weights for each set of prompts.

An abliteration (:meth:`StreamedAbliteration.apply`) projects each chosen layer as :func:`mlx_fun.rewrite.abliterate.
apply_layer` projects it in memory — from the original weights, read from the files — and keeps the tensors it
rewrote in a scratch file in the output's temporary directory (:meth:`~mlx_fun.model.layer_files.LayerFiles.keep`):
every later pass loads the layer with them, so the streamed model is the in-memory abliterated one, and restoring is
forgetting them (every round starts from the original weights, as in memory). The token embedding (single direction)
is projected in memory, as in memory: with the final norm and LM head it is the part of the model every pass needs.
:meth:`StreamedAbliteration.load_for_writing` puts every layer back lazily (the kept tensors included), so the writer
reads and writes one tensor at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .abliterate_rounds import Abliteration


#: the directory, in the output's temporary directory, of the rewritten layers kept while abliterating
SCRATCH = ".abliterated-layers"


def scratch_bytes(adapter, target: str) -> int:
    """The most the kept layers take: every decoder layer's writers of ``target``'s kinds, as stored (read from
    the lazily loaded layers' shapes, before any is released)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .abliterate import KINDS_OF, writers

    return sum(a.nbytes for i in range(len(adapter.decoder_layers())) for w in writers(adapter, i)
               if w.kind in KINDS_OF[target] for _, a in tree_flatten(w.module.parameters()) if isinstance(a, mx.array))


@dataclass
class KeptLayers:
    """An undo record of :meth:`StreamedAbliteration.apply`: the layers whose rewritten tensors are kept on disk."""

    layers: list[int]


class StreamedAbliteration(Abliteration):
    """:class:`Abliteration` on a lazily loaded model whose decoder layers ``files`` reads again for every pass
    (the module docstring)."""

    def __init__(self, loaded, prompts, *, files, **kwargs):
        from ..model.layered import release_layer

        super().__init__(loaded, prompts, **kwargs)  # (reads the layers' shapes: the safety map's experts)
        self.files = files
        self.redispatch = None  # no dequantized experts are kept (the job runs without a dequant cache)
        for layer in files.layers:  # from here on a layer holds weights only while a pass visits it
            release_layer(layer)

    def _capture(self, samples, desc):
        from ..observe.residual import capture_streamed

        return capture_streamed(self.model, self.adapter, samples, load=self.files.load, position=self.position,
                                batch_size=self.batch_size, pad_id=self.pad, budget=self.budget,
                                progress=self.progress, desc=desc)

    def _logprobs(self, samples, desc: str):
        from ..observe.refusal import first_token_logprobs_streamed

        return first_token_logprobs_streamed(self.model, self.adapter, samples, load=self.files.load,
                                             batch_size=max(self.batch_size, 16), pad_id=self.pad,
                                             budget=self.budget, progress=self.progress, desc=desc)

    def _greedy(self, samples, desc: str, logprobs: bool):
        from ..model.layer_files import per_call

        with per_call(self.files):
            return super()._greedy(samples, desc, logprobs)

    def apply(self, done, layers, weight, source):
        """Remove all of ``done``'s directions (the module docstring): the embedding in memory, every chosen layer
        from its original weights into the scratch file its later loads read; returns ``(touched, undo)``."""
        import numpy as np

        from ..model.layered import release_layer
        from .abliterate import apply, apply_layer

        stack = np.concatenate([r.dirs for r in done])
        touched, undo = apply(self.adapter, stack, [], target=self.target, weight=weight, safety=self.safety,
                              embed=None if source is None else stack[:, source])
        kept = []
        for i in layers:
            self.files.load(i, kept=False)
            layer = self.files.layers[i]
            try:
                names, saved = apply_layer(self.adapter, i, _f32(stack[:, i]), target=self.target, weight=weight,
                                           safety=self.safety)
                if names:
                    self.files.keep(i, {f"{w.path}.{k}": w.module[k] for w, tensors in saved for k in tensors})
                    touched[i] = names
                    kept.append(i)
            finally:
                release_layer(layer)
        undo.append(KeptLayers(kept))
        return touched, undo

    def restore(self, undo: list) -> None:
        for entry in reversed(undo):
            if isinstance(entry, KeptLayers):
                self.files.forget(entry.layers)
            else:
                module, saved = entry
                module.update(saved)

    def load_for_writing(self) -> None:
        """Every decoder layer back as lazy arrays (the rewritten tensors from the scratch files): nothing is read
        until the writer evaluates it, one tensor at a time."""
        for i in range(len(self.files.layers)):
            self.files.load(i)


def _f32(a):
    import mlx.core as mx
    import numpy as np

    return mx.array(np.asarray(a, dtype=np.float32))
