"""The checkpoint of a layer-streamed run (a streamed collect, :func:`mlx_fun.observe.collect.collect_streamed`; a
streamed merge, :func:`mlx_fun.rewrite.merge.merge_model`; a streamed abliterate's phases,
:mod:`mlx_fun.rewrite.abliterate_streamed`), so a killed run resumes at the next layer (phase).

It lives in ``.<output name>.stream/`` beside the output: not in the writer's reservation, which is removed on
every failure and on Ctrl-C (:mod:`mlx_fun.core.writer`), and not of the writer's temp naming, which the next
run's stale sweep removes. It survives SIGKILL, SIGTERM and Ctrl-C alike; the job removes it once the output is
written (:func:`mlx_fun.jobs.common.model_job`'s ``checkpointed``). It holds:

- ``identity.json``: what the run is (the job, model and the hash of its config.json, dataset and the hash of the
  sample token ids, calibration, batching and the job's own options, the output): a run of anything else refuses
  to resume, in one line naming the field that differs;
- per layer ``k`` saved: ``hidden-<k>/b<index>.safetensors`` (each batch's hidden state entering layer ``k + 1``
  as ``"h"``, in the model's dtype; a run that spills its hidden states to files hard-links them here instead of
  writing them again, :meth:`mlx_fun.model.layered.LayerDriver.hidden_files`), the job's payload — ``acc-<k>.npz``
  (a collect's float64 statistics so far) and ``data`` in ``state.json`` (JSON: a merge's centroid and group maps,
  per-layer times) and ``arrays-<k>.npz`` (any other arrays: a scan's routing sums) — then ``state.json`` naming ``k``, replaced atomically last, so a kill at any point leaves the
  previous layer's complete checkpoint in force;
- a job that checkpoints phases rather than layers (a streamed abliterate: each round's statistics, each
  measurement) saves one "layer" per phase done, its results in ``data`` and each phase's arrays in a file of their
  own (:meth:`StreamCheckpoint.save_arrays`), written once and kept;
- a rewriting job's rewritten layers, ``layer-<k>.safetensors`` (:meth:`StreamCheckpoint.save_layer`: the layer's
  tensors by their full names, :func:`mlx_fun.output.streaming.save_part`), written after every layer and kept
  until the checkpoint is removed: the output is assembled from them (:meth:`StreamCheckpoint.parts`).

The state is saved after a layer when :meth:`StreamCheckpoint.due`: the first layer, then whenever the work since
the last save took at least ``EVERY`` (10) times what that save took. On the models streaming is for (a layer of a
235B-480B model runs for seconds to minutes) that is every layer; where layers are quick beside writing the carried
hidden states (measured: a 17 GB 48-layer model on an H200, 0.15 s a layer, 0.13 s a save: saving every layer made
the streamed collect 1.4x the in-memory one) it bounds what checkpoints cost to about a tenth of the run, and what a
kill loses to about ten saves' time (a rerun recomputes the layers after the last save, rewriting their files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import mlx.core as mx
import numpy as np

from ..core.paths import link_or_copy
from ..errors import UserError
from .saliency import SaliencyAccumulator

if TYPE_CHECKING:
    from ..model.layered import LayerDriver


def samples_hash(samples: Sequence[Sequence[int]]) -> str:
    """sha256 over the samples' token ids (lengths included), in order."""
    h = hashlib.sha256()
    for s in samples:
        h.update(len(s).to_bytes(8, "little"))
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in s))
    return h.hexdigest()


def file_hash(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def checkpoint_dir(output: str | os.PathLike) -> Path:
    """Where the checkpoint of a streamed run writing ``output`` lives: ``.<name>.stream`` beside it."""
    output = Path(output)
    return output.parent / f".{output.name}.stream"


@dataclass
class Resumed:
    """A checkpoint's state: the last layer done, every batch's hidden state entering the next, the statistics so
    far (a collect's; None where the run keeps none) and the job's JSON payload."""

    layer: int
    states: dict[str, mx.array | Path]
    acc: SaliencyAccumulator | None
    data: dict
    arrays: dict = field(default_factory=dict)  # name → numpy array (``save(arrays=)``)


class StreamCheckpoint:
    """``path``: the checkpoint directory; ``identity``: a JSON-able dict naming the run (see the module docstring);
    ``job``: the job's name in messages (``collect``, ``merge``)."""

    EVERY = 10  # the work between two saves takes at least this many times one save
    clock = staticmethod(time.perf_counter)

    def __init__(self, path: str | os.PathLike, identity: dict, *, job: str = "collect"):
        self.path = Path(path)
        self.identity = json.loads(json.dumps(identity, sort_keys=True, default=str))
        self.job = job
        self._saved_at: float | None = None  # when the last save ended, and what it took
        self._cost = 0.0

    def due(self) -> bool:
        """Whether to save after the layer just done (see the module docstring): the first time, then once the
        work since the last save took ``EVERY`` times that save."""
        return self._saved_at is None or self.clock() - self._saved_at >= self.EVERY * self._cost

    def load(self) -> Resumed | None:
        """The state of a checkpoint of this run, None when there is none (the hidden states by batch name: the
        file holding each, for :meth:`mlx_fun.model.layered.LayerDriver.restore`); a checkpoint of another run is
        refused (``UserError``: the field that differs, and how to start afresh)."""
        state_file = self.path / "state.json"
        if not state_file.is_file():
            return None
        fresh = f"remove {self.path} to start afresh"
        try:
            theirs = json.loads((self.path / "identity.json").read_text())
            state = json.loads(state_file.read_text())
            layer = int(state["layer"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"the checkpoint {self.path} of an interrupted streamed {self.job} is unreadable ({e}); "
                            f"{fresh}.") from None
        differs = sorted(k for k in set(theirs) | set(self.identity) if theirs.get(k) != self.identity.get(k))
        if differs:
            raise UserError(f"the checkpoint {self.path} is of another streamed {self.job} (its "
                            f"{', '.join(differs)} differ from this run's); rerun that command to resume it, or "
                            f"{fresh}.")
        try:
            hidden = self.path / state["hidden"]
            if hidden.is_file():  # one file of every batch's state (an earlier mlx-fun's checkpoint)
                states = mx.load(str(hidden))
            elif hidden.is_dir():
                states = {f.name.removesuffix(".safetensors"): f for f in hidden.glob("*.safetensors")}
            else:
                raise OSError(f"{hidden} is missing")
            acc = SaliencyAccumulator.load(self.path / state["acc"]) if state.get("acc") else None
            arrays = {}
            if state.get("arrays"):
                with np.load(self.path / state["arrays"]) as npz:
                    arrays = {k: npz[k] for k in npz.files}
            for k in range(layer + 1) if state.get("layers") else ():
                if not self.layer_file(k).is_file():
                    raise OSError(f"{self.layer_file(k).name} is missing")
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise UserError(f"the checkpoint {self.path} is damaged ({e}); {fresh}.") from None
        return Resumed(layer, states, acc, state.get("data") or {}, arrays)

    def save(self, layer: int, states: Mapping[str, mx.array | Path], acc: SaliencyAccumulator | None = None, *,
             data: dict | None = None, arrays: Mapping[str, np.ndarray] | None = None) -> None:
        """The checkpoint after ``layer``: its files first (``states``: each batch's hidden state by name, an array
        written alone, or a file holding it as ``"h"`` hard-linked, copied where links fail; ``acc``; ``arrays``), then
        ``state.json`` (with the JSON ``data``) atomically, then the previous layer's files removed. A rewriting
        job has saved the rewritten layers up to ``layer`` (:meth:`save_layer`) before."""
        start = self.clock()
        self.path.mkdir(parents=True, exist_ok=True)
        ident = self.path / "identity.json"
        if not ident.exists():
            _replace_text(ident, json.dumps(self.identity, indent=1, sort_keys=True))
        hidden = f"hidden-{layer}"
        stats = f"acc-{layer}.npz" if acc is not None else None
        folder = self.path / hidden
        shutil.rmtree(folder, ignore_errors=True)  # a kill while this layer was saved before
        folder.mkdir()
        for name, state in states.items():
            target = folder / f"{name}.safetensors"
            if isinstance(state, mx.array):
                mx.save_safetensors(str(target), {"h": state})
            else:
                link_or_copy(state, target)
        if acc is not None:
            acc.write_npz(self.path / stats)
        extra = f"arrays-{layer}.npz" if arrays else None
        if extra:
            np.savez(self.path / extra, **arrays)
        layers = self.layer_file(layer).is_file()
        _replace_text(self.path / "state.json", json.dumps({"layer": layer, "hidden": hidden, "acc": stats,
                                                            "arrays": extra, "layers": layers, "data": data or {}}))
        for entry in self.path.iterdir():
            if entry.name.startswith(("hidden-", "acc-", "arrays-")) and entry.name not in (hidden, stats, extra):
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        self._saved_at = self.clock()
        self._cost = self._saved_at - start

    def layer_file(self, layer: int) -> Path:
        """Where :meth:`save_layer` writes decoder layer ``layer``'s rewritten tensors."""
        return self.path / f"layer-{layer}.safetensors"

    def save_layer(self, layer: int, tensors: dict[str, mx.array], *, parameters: int) -> None:
        """Decoder layer ``layer``'s tensors (full names, as mlx-lm saves them) and their parameter count, into
        :meth:`layer_file` atomically (:func:`mlx_fun.output.streaming.save_part`)."""
        from ..output.streaming import save_part

        self.path.mkdir(parents=True, exist_ok=True)
        save_part(self.layer_file(layer), tensors, parameters=parameters)

    def parts(self, last: int):
        """The rewritten layers ``0..last`` (:class:`mlx_fun.output.streaming.Parts`), for the writer."""
        from ..output.streaming import Parts

        return Parts.read([self.layer_file(k) for k in range(last + 1)])

    def save_arrays(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        """``arrays`` into ``<name>.npz``, atomically, kept until the checkpoint is removed (not replaced at every
        :meth:`save` as ``save(arrays=)`` is): a job that checkpoints phases rather than layers writes each phase's
        arrays once (a streamed abliterate, :class:`mlx_fun.rewrite.abliterate_streamed.Phases`), and the JSON
        ``data`` of its next :meth:`save` names them."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f"{name}.part.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, self.path / f"{name}.npz")

    def load_arrays(self, name: str) -> dict[str, np.ndarray]:
        """What :meth:`save_arrays` wrote as ``name``; a missing or unreadable file is a damaged checkpoint."""
        try:
            with np.load(self.path / f"{name}.npz") as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as e:
            raise UserError(f"the checkpoint {self.path} is damaged ({e}); remove {self.path} to start "
                            "afresh.") from None


def carried(drivers: LayerDriver | Sequence[LayerDriver]) -> dict[str, mx.array | Path]:
    """The hidden states a streamed run's :meth:`StreamCheckpoint.save` keeps: one driver's by batch name (its
    files when it spills, :meth:`~mlx_fun.model.layered.LayerDriver.hidden_files`, else the arrays); several
    drivers' (a streamed eval's: every dataset's, per model) as ``d<n>.b<i>``, ``n`` the driver's place in order."""
    if not isinstance(drivers, Sequence):
        return drivers.hidden_files() or drivers.hidden_states()
    return {f"d{n}.{k}": v for n, d in enumerate(drivers) for k, v in carried(d).items()}


def resume(checkpoint: StreamCheckpoint | None, drivers: LayerDriver | Sequence[LayerDriver], *, layers: int,
           log: Callable[[str], None] | None = None) -> tuple[int, Resumed | None]:
    """Where a layer-streamed run starts, and the checkpoint's state: ``(0, None)`` without a checkpoint holding a
    layer; else ``(k + 1, resumed)`` after its layer ``k``, every driver's hidden states restored (named as
    :func:`carried` names them), decoder layers ``0..k`` of every driver's model released unread, and ``log`` told
    "Resuming at layer k + 1 of ``layers`` from PATH." (or that all ``layers`` are done); the job restores its own
    payload (statistics, sums, maps) from ``resumed``. A checkpoint of another run is refused (:meth:`~StreamCheckpoint.
    load`)."""
    from ..model.layered import release_layer

    resumed = checkpoint.load() if checkpoint is not None else None
    if resumed is None:
        return 0, None
    several = isinstance(drivers, Sequence)
    released: set[int] = set()  # several drivers of one model share its layers
    for n, driver in enumerate(drivers if several else [drivers]):
        prefix = f"d{n}."
        driver.restore({k.removeprefix(prefix): v for k, v in resumed.states.items() if k.startswith(prefix)}
                       if several else resumed.states)
        for layer in driver.layers[: resumed.layer + 1]:
            if id(layer) not in released:
                release_layer(layer)
                released.add(id(layer))
    start = resumed.layer + 1
    if log is not None:
        log(f"Resuming at layer {start} of {layers} from {checkpoint.path}." if start < layers else
            f"Resuming from {checkpoint.path}: all {layers} layers are done.")
    return start, resumed


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
