"""Writing a rewritten model tensor by tensor: the weights half of every mlx-lm directory mlx-fun writes.

Peak memory stays near the largest tensor, not the model, so a 1T-parameter MoE can be pruned on a machine that
cannot hold it once. For each output tensor, in mlx-lm's order (``tree_flatten(model.parameters())``) and with
mlx-lm's sharding rule (``make_shards``: a new shard when the next tensor would pass the limit; ``model.safetensors``
for one shard, ``model-0000i-of-0000n.safetensors`` otherwise, always an index), one of:

- **copy**: the tensor is the source file's, untouched by the rewrite, or one a streamed rewrite has already
  written to a part file of its decoder layer (:class:`Parts`) → its bytes are copied (``copy_file_range`` where
  the kernel has it), never decoded;
- **rows**: the rewrite kept some rows of a source tensor along axis 0 (prune's expert axis: router rows, every
  routed projection's weight / scales / biases) → the kept rows' byte ranges are copied, never decoded;
- **evaluate**: anything else (a patched bias, a merged expert, a tensor mlx-lm's ``sanitize`` rebuilt) →
  the model's array is evaluated alone, written and dropped.

A source tensor counts as untouched only when it is provably the one mlx-lm loaded: the model's parameter is the
very array object it had after loading (:class:`Snapshot`), ``model.sanitize`` hands that file tensor back as
the same object (so checkpoints that mlx-lm rewrites while loading — stacked per-expert tensors, AWQ / GPTQ — are
evaluated, never copied wrongly), and no LoRA adapter was fused into it as it loaded
(:func:`mlx_fun.model.lora.adapted`). Files follow the safetensors format (8-byte header length, JSON header with
``{"format": "mlx"}`` metadata, 8-byte aligned, then the data), which ``mx.load`` and ``mlx_lm.load`` read.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import UserError

DEFAULT_SHARD_BYTES = 5 << 30  # mlx-lm's MAX_FILE_SIZE_GB
_CHUNK = 16 << 20
_DTYPES = {mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.int8: "I8",
           mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.float16: "F16", mx.bfloat16: "BF16",
           mx.float32: "F32", mx.float64: "F64", mx.complex64: "C64"}
_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


@dataclass(frozen=True)
class SourceTensor:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in ``file``
    nbytes: int


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """A safetensors file's JSON header and the absolute offset its data starts at."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise UserError(f"{path} is not a safetensors file (shorter than 8 bytes); re-download or re-convert it.")
        (n,) = struct.unpack("<Q", raw)
        from ..core import json_input

        try:
            header = json_input.parse(f.read(n), f"the safetensors header of {path}", expect=dict,
                                      fix="re-download or re-convert it.")
        except (MemoryError, OverflowError):
            raise UserError(f"{path} has no valid safetensors header; re-download or re-convert it.") from None
    return header, 8 + n


def file_tensors(files) -> dict[str, SourceTensor]:
    """Every tensor of the safetensors ``files`` (a later file's tensor of the same name wins), with where its bytes
    are."""
    out: dict[str, SourceTensor] = {}
    for wf in files:
        header, base = read_header(wf)
        for name, t in header.items():
            if name != "__metadata__":
                b, e = t["data_offsets"]
                out[name] = SourceTensor(str(wf), t["dtype"], tuple(t["shape"]), base + b, e - b)
    return out


def weight_files(model_dir: str | os.PathLike) -> list[str]:
    """The safetensors files mlx-lm's loader reads from ``model_dir``, in its order (``model*.safetensors``)."""
    return glob.glob(str(Path(model_dir) / "model*.safetensors"))


def source_tensors(model_dir: str | os.PathLike) -> dict[str, SourceTensor]:
    """Every tensor of the files mlx-lm loads from ``model_dir`` (later files win, as in mlx-lm), with where its
    bytes are."""
    return file_tensors(weight_files(model_dir))


class Snapshot:
    """The model's parameters right after a lazy ``mlx_lm.load``, and which of them are the source files' own
    tensors (see the module docstring). Take it before rewriting; :func:`write_weights` copies those still
    holding the same array object."""

    def __init__(self, model, model_dir: str | os.PathLike, config: dict):
        from mlx.utils import tree_flatten

        from ..model.lora import adapted

        self.params = dict(tree_flatten(model.parameters()))
        self.sources = source_tensors(model_dir)
        qc = config.get("quantization_config") or {}
        rebuilt_on_load = "quantization" not in config and qc.get("quant_method") in ("awq", "gptq")
        raw = {}
        for wf in weight_files(model_dir):
            raw.update(mx.load(wf))
        kept = model.sanitize(dict(raw)) if hasattr(model, "sanitize") else raw
        changed = adapted(model)  # fused with a LoRA adapter as it loaded: no longer the files' tensors
        self.verbatim = set() if rebuilt_on_load else {
            k for k, v in kept.items() if raw.get(k) is v and k in self.params and k in self.sources
            and k not in changed and _matches(self.sources[k], self.params[k])}

    def source(self, name: str, current) -> SourceTensor | None:
        """The file tensor ``current`` (a parameter now) still is, or None."""
        if name in self.verbatim and self.params.get(name) is current:
            return self.sources[name]
        return None


def _matches(src: SourceTensor, arr) -> bool:
    return src.shape == tuple(arr.shape) and src.dtype == _DTYPES.get(arr.dtype)


@dataclass
class Parts:
    """Tensors a streamed rewrite has already written, decoder layer by decoder layer, to safetensors files of their
    own (:func:`save_part`), which the model handed to :func:`write_weights` no longer holds (its visited layers were
    released): the writer copies their bytes, never decodes them. ``parameters``: mlx-lm's count of them
    (``get_total_parameters``' rule: a quantized weight counts its unpacked elements), which the model's own count
    then misses."""

    tensors: dict[str, SourceTensor]
    parameters: int = 0

    @classmethod
    def read(cls, files) -> "Parts":
        """The parts in ``files`` (each written by :func:`save_part`)."""
        parameters = 0
        for f in files:
            header, _ = read_header(f)
            parameters += int((header.get("__metadata__") or {}).get("parameters", 0))
        return cls(file_tensors(files), parameters)


def save_part(path: str | os.PathLike, tensors: dict[str, mx.array], *, parameters: int) -> None:
    """Write ``tensors`` (full parameter names, as mlx-lm saves them) and their ``parameters`` count to the
    safetensors file ``path`` (a ``.safetensors`` name), atomically: a kill leaves the previous file or none."""
    path = Path(path)
    tmp = path.with_name(path.stem + ".part.safetensors")
    mx.save_safetensors(str(tmp), tensors, metadata={"format": "mlx", "parameters": str(int(parameters))})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_bytes(text: str | int) -> int:
    """``--max-shard-size`` (``5GB``, ``500MB``, ``64MiB``, a byte count; powers of 1024 like mlx-lm's GB) → bytes."""
    from ..errors import param
    from ..core.sizes import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{param('max_shard_size')} must be a positive size such as 5GB or 500MB, got {text!r}.")
    return value


@dataclass
class _Out:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    how: str  # copy | rows | evaluate
    src: SourceTensor | None = None
    rows: list[int] | None = None


def plan(model, snapshot: Snapshot | None, rows: dict[str, list[int]] | None = None,
         parts: Parts | None = None) -> list[_Out]:
    """What to do for each output tensor, in mlx-lm's order. ``rows`` maps a parameter to the source rows (axis 0)
    it keeps; it is used only when that parameter's snapshot tensor is a verbatim file tensor. A tensor of ``parts``
    is copied from its part file, whatever the model holds under its name (an emptied array)."""
    from mlx.utils import tree_flatten

    out = []
    written = parts.tensors if parts is not None else {}
    for name, arr in tree_flatten(model.parameters()):
        if name in written:
            src = written[name]
            out.append(_Out(name, src.dtype, src.shape, src.nbytes, "copy", src))
            continue
        dtype = _DTYPES.get(arr.dtype)
        if dtype is None:
            raise UserError(f"parameter {name} has dtype {arr.dtype}, which safetensors cannot store.")
        shape = tuple(arr.shape)
        src = snapshot.source(name, arr) if snapshot else None
        keep = (rows or {}).get(name)
        if src is None and keep is not None and snapshot and name in snapshot.verbatim:
            src = snapshot.sources[name]
            if src.shape[1:] == shape[1:] and len(keep) == shape[0] and src.dtype == dtype:
                out.append(_Out(name, dtype, shape, arr.nbytes, "rows", src, sorted(int(r) for r in keep)))
                continue
        out.append(_Out(name, dtype, shape, arr.nbytes, "copy" if src is not None else "evaluate", src))
    return out


def _shards(items: list[_Out], max_bytes: int) -> list[list[_Out]]:
    shards: list[list[_Out]] = []
    size = 0
    for it in items:  # mlx-lm's make_shards rule (which takes whole GiB only; --max-shard-size takes bytes)
        if not shards or size + it.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def _copy(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
    """``n`` bytes from ``src_fd`` at ``src_off`` to ``dst_fd`` at ``dst_off``, in the kernel where it can."""
    while n > 0:
        step = min(n, _CHUNK)  # measured: 8-16 MiB calls copy ~1.6x faster than 1 GiB ones (page cache, Linux)
        done = 0
        if hasattr(os, "copy_file_range"):
            try:
                done = os.copy_file_range(src_fd, dst_fd, step, src_off, dst_off)
            except OSError:
                done = 0
        if done <= 0:  # no copy_file_range (macOS), or a filesystem pair it refuses
            buf = os.pread(src_fd, step, src_off)
            if not buf:
                raise OSError(f"unexpected end of a source file at byte {src_off}")
            done = os.pwrite(dst_fd, buf, dst_off)
        src_off, dst_off, n = src_off + done, dst_off + done, n - done


def _array_bytes(arr) -> np.ndarray:
    mx.eval(arr)
    view = arr if arr.dtype in (mx.float32, mx.float16, mx.uint8, mx.uint32, mx.int8, mx.int32) else mx.view(
        arr, _UINT[arr.dtype.size])
    return np.ascontiguousarray(np.asarray(view))


def _write_shard(path: Path, items: list[_Out], params: dict, fds: dict, bar) -> None:
    header: dict = {"__metadata__": {"format": "mlx"}}
    off = 0
    for it in items:
        header[it.name] = {"dtype": it.dtype, "shape": list(it.shape), "data_offsets": [off, off + it.nbytes]}
        off += it.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    base = 8 + len(blob)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        os.write(fd, struct.pack("<Q", len(blob)) + blob)
        pos = base
        for it in items:
            if it.how == "evaluate":
                data = _array_bytes(params.pop(it.name))
                if data.nbytes != it.nbytes:
                    raise RuntimeError(f"{it.name}: {data.nbytes} bytes evaluated, {it.nbytes} expected")
                mv = memoryview(data).cast("B")
                done = 0
                while done < len(mv):
                    done += os.pwrite(fd, mv[done:done + _CHUNK], pos + done)
                del data, mv
            else:
                params.pop(it.name, None)
                if it.src.file not in fds:
                    fds[it.src.file] = os.open(it.src.file, os.O_RDONLY | os.O_CLOEXEC)
                sfd = fds[it.src.file]
                if it.how == "copy":
                    _copy(sfd, fd, it.src.start, pos, it.nbytes)
                else:
                    row = it.src.nbytes // it.src.shape[0]
                    at = pos
                    for first, count in _runs(it.rows):
                        _copy(sfd, fd, it.src.start + first * row, at, count * row)
                        at += count * row
            pos += it.nbytes
            if bar is not None:
                bar.update(it.nbytes)
    finally:
        os.close(fd)


def _runs(rows: list[int]):
    """Sorted row indices → (first, count) runs of consecutive rows."""
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        yield rows[i], j - i + 1
        i = j + 1


@dataclass
class WriteStats:
    copied: int = 0  # bytes copied verbatim (whole tensors or kept rows)
    evaluated: int = 0  # bytes computed
    shards: int = 0


def write_weights(dest: str | os.PathLike, model, *, snapshot: Snapshot | None = None,
                  rows: dict[str, list[int]] | None = None, parts: Parts | None = None,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, donate: bool = False,
                  progress: bool = False) -> WriteStats:
    """Write ``model``'s weights into the directory ``dest`` as mlx-lm's ``save_model`` would (same names, values,
    shard rule, index), tensor by tensor (module docstring). ``parts``: tensors already written to part files by a
    streamed rewrite (:class:`Parts`), copied in the model's order in place of its emptied arrays. ``donate``
    empties the model's parameters first, so each evaluated tensor is freed once written (the model is unusable
    afterwards)."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import get_total_parameters

    items = plan(model, snapshot, rows, parts)
    if snapshot is not None and donate:
        snapshot.params.clear()  # the loaded arrays: freed as their tensors are written
    total_parameters = get_total_parameters(model) + (parts.parameters if parts is not None else 0)
    params = dict(tree_flatten(model.parameters()))
    if donate:
        model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    shards = _shards(items, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(it.nbytes for it in items), unit="B", unit_scale=True, unit_divisor=1024,
                   desc="writing", dynamic_ncols=True)
    fds: dict[str, int] = {}
    try:
        for shard, name in zip(shards, names):
            _write_shard(Path(dest) / name, shard, params, fds, bar)
    finally:
        for fd in fds.values():
            os.close(fd)
        if bar is not None:
            bar.close()
    index = {"metadata": {"total_size": sum(it.nbytes for it in items), "total_parameters": total_parameters},
             "weight_map": {it.name: n for shard, n in zip(shards, names) for it in shard}}
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    with open(Path(dest) / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    stats = WriteStats(shards=len(shards))
    for it in items:
        if it.how == "evaluate":
            stats.evaluated += it.nbytes
        else:
            stats.copied += it.nbytes
    return stats
