"""A model's decoder layers read again from its files: what a streamed job that runs the model more than once needs.

:class:`mlx_fun.model.layered.LayerDriver` (``release=True``) empties each layer after its visit, which is all a job
that runs the model once needs (collect, eval, the scans). A job that runs it again — abliterate's captures,
first-token log-probs and its greedy replies, one pass over the layers per generated token — reads the layer from
the safetensors files again: :meth:`LayerFiles.load` puts lazy arrays into decoder layer ``i`` (``mx.load`` reads
only the headers; a tensor's bytes are read when a forward first evaluates it), built as mlx-lm's loader builds
them: through the model's own ``sanitize`` (a per-expert checkpoint that mlx-lm stacks on load is stacked again),
given the file tensors of layer ``i`` (and of layer 0, which some sanitizers look at to decide what to do; every
file tensor where that does not give the layer), and checked against the names, shapes and dtypes the layer had
when it was loaded.

:meth:`LayerFiles.keep` stores rewritten tensors of a layer in a scratch file (a streamed abliterate's: in its
checkpoint, so a rerun after a kill finds them by their key, :meth:`LayerFiles.reuse`); later loads read them from
there instead of the model's files, so a rewrite computed once is seen on every pass and in
the written model (the writer evaluates them one tensor at a time), and :meth:`LayerFiles.forget` returns the layer
to its original weights. :func:`per_call` makes every forward of the model — mlx-lm's own generation included —
load each decoder layer when it is called, run it, evaluate its output and the cache it wrote, and release it.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import re
from pathlib import Path

import mlx.core as mx

from ..errors import UserError, param
from . import layerwise
from .layered import release_layer


class LayerFiles:
    """Decoder layers of ``model`` (``adapter.decoder_layers()``), read again on demand from the safetensors files
    of ``model_dir`` (see the module docstring). Build it right after a (lazy) load, before any layer is released:
    it records what each layer holds. ``scratch``: the directory :meth:`keep` writes into."""

    def __init__(self, model, adapter, model_dir: str | os.PathLike, *, scratch: str | os.PathLike | None = None):
        from mlx.utils import tree_flatten

        _check_rebuilt_on_load(adapter.config)
        self.model, self.layers = model, adapter.decoder_layers()
        names = {id(m): n for n, m in model.named_modules()}
        self.prefixes = [names[id(layer)] + "." for layer in self.layers]
        self.expected = [{k: (tuple(v.shape), v.dtype) for k, v in tree_flatten(layer.parameters())}
                         for layer in self.layers]
        if any(e and all(shape == (0,) for shape, _ in e.values()) for e in self.expected):
            raise ValueError("LayerFiles needs the layers as loaded: a layer was already released")
        self.file_of: dict[str, str] = {}  # file tensor -> the file it is read from (later files win, as in mlx-lm)
        for f in glob.glob(str(Path(model_dir) / "model*.safetensors")):  # mlx-lm's loader's files, in its order
            self.file_of.update(dict.fromkeys(mx.load(f), f))
        self.of_layer = self._group_by_layer()
        self.whole: set[int] = set()  # layers sanitized from every file tensor (their own did not give the layer)
        self.scratch = None if scratch is None else Path(scratch)
        self.kept: dict[int, Path] = {}
        self._names = itertools.count()

    def _group_by_layer(self) -> dict[int, list[str]]:
        """File tensor names by the decoder layer their name puts them in (``<container>.<i>.``, the container the
        model's own layer paths use: ``layers``, ``h``, ...); names of no layer are left out."""
        out: dict[int, list[str]] = {}
        containers = {p.rsplit(".", 3)[-3] for p in self.prefixes if p.count(".") >= 2}
        if not containers:
            return out
        pattern = re.compile(r"(?:^|\.)(?:%s)\.(\d+)\." % "|".join(map(re.escape, sorted(containers))))
        for name in self.file_of:
            if (m := pattern.search(name)) is not None:
                out.setdefault(int(m.group(1)), []).append(name)
        return out

    def load(self, i: int, *, kept: bool = True) -> None:
        """Put decoder layer ``i``'s weights back as lazy arrays read from the files (and, with ``kept``, the
        tensors :meth:`keep` stored for it); nothing is read until a forward evaluates them."""
        params = self._read(i)
        if kept and i in self.kept:
            params.update(mx.load(str(self.kept[i])))
        self._check(i, params, final=True)
        from mlx.utils import tree_unflatten

        self.layers[i].update(tree_unflatten(list(params.items())))

    def _read(self, i: int) -> dict[str, mx.array]:
        if i not in self.whole:
            names = self.of_layer.get(i, []) + (self.of_layer.get(0, []) if i else [])
            try:
                got = self._sanitized(i, names)
            except Exception:  # noqa: BLE001 -- a sanitizer that needs tensors of other layers: read them all
                got = None
            if got is not None and self._check(i, got):
                return got
            self.whole.add(i)
        return self._sanitized(i, list(self.file_of))

    def _sanitized(self, i: int, names: list[str]) -> dict[str, mx.array]:
        """Layer ``i``'s tensors (by their names within the layer) of ``model.sanitize`` over the file tensors
        ``names`` (lazy)."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[name], []).append(name)
        raw = {}
        for f, wanted in by_file.items():
            tensors = mx.load(f)
            raw.update({k: tensors[k] for k in wanted})
        out = self.model.sanitize(raw) if hasattr(self.model, "sanitize") else raw
        prefix = self.prefixes[i]
        return {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)}

    def _check(self, i: int, params: dict[str, mx.array], *, final: bool = False) -> bool:
        """Do ``params`` hold layer ``i`` as it was loaded (names, shapes, dtypes)? ``final``: a one-line
        ``UserError`` where they do not."""
        want = self.expected[i]
        got = {k: (tuple(v.shape), v.dtype) for k, v in params.items()}
        if got == want:
            return True
        if not final:
            return False
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        differ = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        detail = "; ".join(f"{what}: {', '.join(names[:3])}" for what, names in
                           (("missing", missing), ("not in the model", extra), ("other shape or dtype", differ))
                           if names)
        raise UserError(f"decoder layer {i} cannot be read again from the model's files as mlx-lm loaded it "
                        f"({detail}); run it without {param('stream_layers')}.")

    def keep(self, i: int, params: dict[str, mx.array], *, key: str | None = None) -> None:
        """Store ``params`` (names within layer ``i``: rewritten tensors) in a scratch file; :meth:`load` reads them
        from there instead of the model's files until :meth:`forget`. They are evaluated and written here, under a
        temporary name renamed into place. ``key`` names the file (``layer<i>-<key>``): a later :meth:`reuse` of the
        same key (a rerun's, the scratch directory having survived a kill) finds it."""
        if self.scratch is None:
            raise ValueError("LayerFiles.keep needs a scratch directory")
        unknown = sorted(set(params) - set(self.expected[i]))
        if unknown:
            raise ValueError(f"layer {i} has no parameter {unknown[0]}")
        self.forget([i])
        self.scratch.mkdir(parents=True, exist_ok=True)
        path = self._kept_path(i, key if key is not None else str(next(self._names)))
        tmp = path.with_name(path.stem + ".part.safetensors")
        mx.save_safetensors(str(tmp), params)
        os.replace(tmp, path)
        self.kept[i] = path

    def reuse(self, i: int, key: str) -> bool:
        """Read layer ``i``'s rewritten tensors from the file :meth:`keep` wrote under ``key``, if it is there
        (True); the file is complete (renamed into place once written)."""
        if self.scratch is None or not (path := self._kept_path(i, key)).is_file():
            return False
        if self.kept.get(i) != path:
            self.forget([i])
            self.kept[i] = path
        return True

    def _kept_path(self, i: int, key: str) -> Path:
        return self.scratch / f"layer{i}-{key}.safetensors"

    def forget(self, layers=None) -> None:
        """Layers ``layers`` (default: all) read their original weights again; their scratch files are removed."""
        for i in list(self.kept) if layers is None else layers:
            path = self.kept.pop(i, None)
            if path is not None:
                path.unlink(missing_ok=True)


def _check_rebuilt_on_load(config: dict) -> None:
    """AutoAWQ / GPTQ checkpoints are converted by mlx-lm's loader after ``sanitize``; their layers are not read
    again (one line)."""
    qc = config.get("quantization_config") or {}
    if "quantization" not in config and isinstance(qc, dict) and qc.get("quant_method") in ("awq", "gptq"):
        raise UserError(f"this {qc['quant_method'].upper()} checkpoint is converted by mlx-lm while it loads, so its "
                        f"decoder layers cannot be read again one at a time; convert it with mlx_lm.convert first, "
                        f"or run without {param('stream_layers')}.")


def _arrays(obj, out: list, depth: int = 0) -> list:
    """Every ``mx.array`` in ``obj`` (tuples, lists, dicts, and the ``state`` of mlx-lm's caches)."""
    if depth > 8:
        return out
    if isinstance(obj, mx.array):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _arrays(x, out, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            _arrays(x, out, depth + 1)
    elif hasattr(obj, "state") and not isinstance(obj, type):
        try:
            state = obj.state
        except Exception:  # noqa: BLE001 -- an empty cache's state may not be readable
            return out
        _arrays(state, out, depth + 1)
    return out


@contextlib.contextmanager
def per_call(files: LayerFiles):
    """Within the block, calling decoder layer ``i`` loads it (:meth:`LayerFiles.load`), runs it, evaluates its
    output and every array of the arguments it was given (the KV / SSM cache it wrote), and releases it: any forward
    of the model — mlx-lm's generation too — holds one decoder layer's weights at a time and reads every layer from
    its files again."""
    layers = files.layers
    calls = [type(layer).__call__ for layer in layers]  # the layers' own calls, taken before the swap

    def make(i):
        def fn(x, *args, **kwargs):
            files.load(i)
            try:
                out = calls[i](layers[i], x, *args, **kwargs)
                mx.eval(_arrays(out, []), _arrays((args, kwargs), []))
            finally:
                release_layer(layers[i])
            return out

        return fn

    with layerwise.swap_layer_calls(layers, make):
        yield
