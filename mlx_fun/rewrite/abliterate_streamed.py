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
rewrote in a file of the run's checkpoint, named by what the projection took (layer, directions, weight, target:
:meth:`~mlx_fun.model.layer_files.LayerFiles.keep`): every later pass loads the layer with them, so the streamed model
is the in-memory abliterated one, and restoring is forgetting them (every round starts from the original weights, as
in memory). The token embedding (single direction) is projected in memory, as in memory: with the final norm and LM
head it is the part of the model every pass needs. :meth:`StreamedAbliteration.load_for_writing` puts every layer
back lazily (the kept tensors included), so the writer reads and writes one tensor at a time.

A streamed abliterate runs for hours on a big model (every reply token rereads the weights), so it is resumable
(:class:`Phases`): its checkpoint (:class:`mlx_fun.observe.checkpoint.StreamCheckpoint`, ``.<output>.stream/``
beside the output) records every phase as it ends — round 1's statistics (the captures' directions and the original
model's capture log-probs), the original model's measurement (with its evaluation log-probs), each later round's
statistics and capture KL, each search trial's measurement, the final measurement — and holds the kept projected
layers. The run is deterministic given the checkpoint's identity (model, prompts, options), so a rerun of the same
command makes the same calls in the same order: the phases recorded are answered from the checkpoint without running
the model, the projections between them wait (:class:`Deferred`) until a pass needs the model (a kept layer of the
same projection read back, not made again), and the run goes on from the first phase not recorded, to the same
files an uninterrupted run writes. The job removes the checkpoint once the output is written.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from ..errors import UserError
from .abliterate_rounds import Abliteration, Stats, Trial


#: the directory, in the run's checkpoint, of the rewritten layers kept while abliterating
SCRATCH = "projected-layers"


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


@dataclass(eq=False)
class Deferred:
    """An undo record of a projection a resumed run has not made yet (``args``: :meth:`StreamedAbliteration.apply`'s),
    while it replays recorded phases; ``undo``: the projection's own record once made."""

    args: tuple
    undo: list | None = None


class Phases:
    """The phases of a streamed abliterate in its checkpoint (the module docstring): ``data["phases"]``, in order,
    ``{"phase": label, "value": its JSON result, "arrays": whether phase-<k>.npz holds its arrays}``, one
    :meth:`~mlx_fun.observe.checkpoint.StreamCheckpoint.save` per phase done (each phase is at least one pass over
    every layer's weights, so a save after each costs little beside it)."""

    def __init__(self, checkpoint, log):
        self.checkpoint = checkpoint
        resumed = checkpoint.load()  # (a checkpoint of another run is refused, naming what differs)
        self.done: list[dict] = [] if resumed is None else list(resumed.data.get("phases", []))
        self.next = 0
        if self.done:
            log(f"Resuming after {self.done[-1]['phase']} ({len(self.done)} phases done) from {checkpoint.path}.")

    @property
    def replaying(self) -> bool:
        return self.next < len(self.done)

    def run(self, label: str, compute, encode, decode):
        """The phase ``label``'s result: recorded (``decode(value, arrays)``), or ``compute()`` recorded
        (``encode(result) -> (value, arrays)``)."""
        k = self.next
        if self.replaying:
            entry = self.done[k]
            if entry.get("phase") != label:
                raise UserError(f"the checkpoint {self.checkpoint.path} is damaged (its phase {k + 1} is "
                                f"{entry.get('phase')}, this run's is {label}); remove {self.checkpoint.path} to start "
                                "afresh.")
            self.next += 1
            return decode(entry["value"], self.checkpoint.load_arrays(f"phase-{k}") if entry["arrays"] else {})
        result = compute()
        value, arrays = encode(result)
        if arrays:
            self.checkpoint.save_arrays(f"phase-{k}", arrays)
        self.done.append({"phase": label, "value": value, "arrays": bool(arrays)})
        self.next += 1
        self.checkpoint.save(k, {}, data={"phases": self.done})
        return result


class StreamedAbliteration(Abliteration):
    """:class:`Abliteration` on a lazily loaded model whose decoder layers ``files`` reads again for every pass,
    resumable from ``checkpoint`` (the module docstring; ``files.scratch`` lies in it)."""

    def __init__(self, loaded, prompts, *, files, checkpoint, **kwargs):
        from ..model.layered import release_layer

        super().__init__(loaded, prompts, **kwargs)  # (reads the layers' shapes: the safety map's experts)
        self.files = files
        self.redispatch = None  # no dequantized experts are kept (the job runs without a dequant cache)
        self.phases = Phases(checkpoint, self.log)
        self._pending: list[Deferred] = []  # projections deferred while replaying, not undone yet
        self._trial = None  # the search's trials measured so far (None: not searching)
        for layer in files.layers:  # from here on a layer holds weights only while a pass visits it
            release_layer(layer)

    # ------------------------------------------------------------------ the phases (recorded in the checkpoint)
    def _phase(self, label: str, compute, encode, decode):
        def run():
            self._materialize()  # the model as the projections so far left it
            return compute()

        return self.phases.run(label, run, encode, decode)

    def statistics(self, r: int) -> Stats | None:
        compute = super().statistics

        def encode(stats):
            if stats is None:
                return None, {}
            arrays = {"dirs": stats.dirs, "norms": stats.norms,
                      **{f"group{j}": g for j, (_, _, g) in enumerate(stats.groups)}}
            if r == 1:
                arrays["reference"] = _numpy(self._bound_reference)
            return ({"counts": [stats.refused, stats.harmful, stats.answered, stats.benign],
                     "groups": [[k, n] for k, n, _ in stats.groups]}, arrays)

        def decode(value, arrays):
            if value is None:
                return None
            if r == 1:
                self._bound_reference = _mlx(arrays["reference"])
            groups = [(k, n, arrays[f"group{j}"]) for j, (k, n) in enumerate(value["groups"])]
            return Stats(*value["counts"], arrays["dirs"], arrays["norms"], groups)

        return self._phase(f"round {r}'s statistics", lambda: compute(r), encode, decode)

    def measure(self, layers, weight, rounds=0, source=None, original: bool = False) -> Trial:
        compute = super().measure
        if original:
            label = "the original model's measurement"
        elif self._trial is not None:
            self._trial += 1
            label = f"search trial {self._trial}"
        else:
            label = "the abliterated model's measurement"

        def encode(trial):
            return asdict(trial), {"reference": _numpy(self.reference)} if original else {}

        def decode(value, arrays):
            if original:
                self.reference = _mlx(arrays["reference"])
            return Trial(**value)

        return self._phase(label, lambda: compute(layers, weight, rounds, source, original), encode, decode)

    def _bound_kl(self, r: int) -> float:
        compute = super()._bound_kl
        return self._phase(f"round {r}'s held-out KL", lambda: compute(r), lambda kl: (kl, {}),
                           lambda value, _: float(value))

    def search(self, first, candidates, rounds: int, progress: bool):
        self._trial = 0
        try:
            return super().search(first, candidates, rounds, progress)
        finally:
            self._trial = None

    # ------------------------------------------------------------------ the passes
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

    # ------------------------------------------------------------------ the projections
    def apply(self, done, layers, weight, source):
        """Remove all of ``done``'s directions (the module docstring): the embedding in memory, every chosen layer
        from its original weights into the kept file its later loads read; returns ``(touched, undo)``. While the
        run replays recorded phases the projection waits (:class:`Deferred`; ``touched`` from the layers' shapes)."""
        if self.phases.replaying:
            self._pending.append(Deferred((list(done), list(layers), weight, source)))
            return self._touched(layers, source), [self._pending[-1]]
        self._materialize()
        return self._project(done, layers, weight, source)

    def _project(self, done, layers, weight, source):
        import numpy as np

        from ..model.layered import release_layer
        from .abliterate import apply, apply_layer

        stack = np.concatenate([r.dirs for r in done])
        touched, undo = apply(self.adapter, stack, [], target=self.target, weight=weight, safety=self.safety,
                              embed=None if source is None else stack[:, source])
        kept = []
        for i in layers:
            d = np.asarray(stack[:, i], dtype=np.float32)
            key = self._key(i, d, weight)
            if self.files.reuse(i, key):  # made before (a killed run's last projection): read back
                names = self._names(i)
            else:
                self.files.load(i, kept=False)
                layer = self.files.layers[i]
                try:
                    names, saved = apply_layer(self.adapter, i, _mlx(d), target=self.target, weight=weight,
                                               safety=self.safety)
                    if names:
                        self.files.keep(i, {f"{w.path}.{k}": w.module[k] for w, tensors in saved for k in tensors},
                                        key=key)
                finally:
                    release_layer(layer)
            if names:
                touched[i] = names
                kept.append(i)
        undo.append(KeptLayers(kept))
        return touched, undo

    def _key(self, i: int, d, weight) -> str:
        """What layer ``i``'s projection takes (its directions, weight, target and safety experts), hashed: the
        name of its kept file."""
        h = hashlib.sha256(d.tobytes())
        h.update(repr((i, d.shape, float(weight), self.target, (self.safety or {}).get(i))).encode())
        return h.hexdigest()[:24]

    def _names(self, i: int) -> list[str]:
        """The names :func:`mlx_fun.rewrite.abliterate.apply_layer` reports for layer ``i`` (from the shapes of its
        lazily loaded tensors; no weight is read)."""
        from ..model.layered import release_layer
        from .abliterate import targets

        self.files.load(i, kept=False)
        try:
            return [name for _, _, name in targets(self.adapter, i, target=self.target, safety=self.safety)]
        finally:
            release_layer(self.files.layers[i])

    def _touched(self, layers, source) -> dict:
        """What :meth:`_project` would report as touched, without projecting."""
        from .abliterate import projected_embedding

        found = None if source is None else projected_embedding(self.adapter, self.target)
        touched = {} if found is None else {"embedding": [found[0]]}
        for i in layers:
            if names := self._names(i):
                touched[i] = names
        return touched

    def _materialize(self) -> None:
        """Make the projections deferred while replaying (and not undone), in order."""
        while self._pending:
            entry = self._pending.pop(0)
            entry.undo = self._project(*entry.args)[1]

    def restore(self, undo: list) -> None:
        for entry in reversed(undo):
            if isinstance(entry, Deferred):
                if entry in self._pending:
                    self._pending.remove(entry)
                if entry.undo is not None:
                    self.restore(entry.undo)
            elif isinstance(entry, KeptLayers):
                self.files.forget(entry.layers)
            else:
                module, saved = entry
                module.update(saved)

    def load_for_writing(self) -> None:
        """Every decoder layer back as lazy arrays (the rewritten tensors from the kept files; a projection deferred
        while replaying made first): nothing is read until the writer evaluates it, one tensor at a time."""
        self._materialize()
        for i in range(len(self.files.layers)):
            self.files.load(i)


def _mlx(a):
    """A numpy array as an ``mx.array`` of its dtype (float32 directions, log-probs), bit for bit."""
    import mlx.core as mx

    return mx.array(a)


def _numpy(a):
    import numpy as np

    return np.array(a, copy=True)
