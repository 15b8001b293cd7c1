"""Where a saliency file came from: the model it was collected on (its name and a fingerprint of its weights) and
the dataset (its path and a hash of the sample token ids), so a job that reads the file for another model can say so.

:func:`fingerprint` is cheap on any size of model and tells a base model from its fine-tune: sha256 over
``config.json``'s bytes, then, for every tensor of the weight files mlx-lm loads
(:func:`mlx_fun.output.streaming.source_tensors`, sorted by name), its name, dtype and shape (from the safetensors
headers) and :data:`SAMPLE_BYTES` bytes from the middle of its data — for at most :data:`MAX_SAMPLED` tensors
evenly spaced over the sorted names (every tensor up to that many). A sample per tensor, rather than byte samples at
fixed offsets of each file, catches a fine-tune that rewrote only some matrices (a merged LoRA of the attention
projections), which a few offsets per file of a mostly-experts model would likely miss; a change confined to rows no
sample falls in (new embedding rows alone) is not seen. Independent of how the weights are sharded. Reads the
headers and about 4 KiB (a page) per sampled tensor: ~16 MB at most, whatever the model's size.

:func:`collected_on` is what ``collect`` records (``SaliencyAccumulator.provenance``); :func:`mismatch` is the
one-line warning a job gives when the file's fingerprint is not the model's.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

#: bytes read from the middle of each sampled tensor
SAMPLE_BYTES = 64
#: the most tensors sampled (evenly spaced over the sorted names); names, dtypes and shapes are hashed for all
MAX_SAMPLED = 4096
#: the provenance fields of a saliency file (``.npz`` keys), in the order they are shown
FIELDS = ("source_model", "source_fingerprint", "source_dataset", "source_samples_sha256")


def fingerprint(model_dir: str | os.PathLike) -> str:
    """The sha256 (hex) of ``model_dir``'s config.json and a sample of every tensor's bytes (module docstring)."""
    from ..output.streaming import source_tensors

    h = hashlib.sha256(Path(model_dir, "config.json").read_bytes())
    tensors = source_tensors(model_dir)
    names = sorted(tensors)
    step = max(1, -(-len(names) // MAX_SAMPLED))
    sampled = set(names[::step])
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(tensors[name].file, []).append(name)
    samples: dict[str, bytes] = {}
    for file, in_file in by_file.items():
        with open(file, "rb") as f:
            for name in sorted((n for n in in_file if n in sampled), key=lambda n: tensors[n].start):
                t = tensors[name]
                f.seek(t.start + max(0, t.nbytes // 2 - SAMPLE_BYTES // 2))
                samples[name] = f.read(min(SAMPLE_BYTES, t.nbytes))
    for name in names:
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(samples.get(name, b""))
    return h.hexdigest()


def model_name(model_dir: str | os.PathLike) -> str:
    """How messages name the model at ``model_dir``: its Hugging Face repo id where the job resolved one, else the
    directory's name (:func:`mlx_fun.model.hub.short_name`)."""
    from ..model.hub import short_name

    return short_name(model_dir)


def collected_on(model_dir: str | os.PathLike, dataset: str | os.PathLike, samples_sha256: str) -> dict:
    """The provenance ``collect`` records: the model's name and fingerprint, the dataset as given and the sha256 of
    the samples' token ids (``samples_sha256``: :func:`mlx_fun.observe.checkpoint.samples_hash`)."""
    return {"source_model": model_name(model_dir), "source_fingerprint": fingerprint(model_dir),
            "source_dataset": os.fspath(dataset), "source_samples_sha256": samples_sha256}


def mismatch(provenance: dict, model_dir: str | os.PathLike, label: str) -> str | None:
    """A one-line warning when the file named ``label`` records a fingerprint that is not ``model_dir``'s; None when
    it matches or records none (a file written before mlx-fun recorded it, or by another tool)."""
    recorded = provenance.get("source_fingerprint")
    if not recorded:
        return None
    here = fingerprint(model_dir)
    if here == recorded:
        return None
    theirs = f"{provenance.get('source_model') or 'another model'} (weights {recorded[:12]})"
    return (f"{label} was collected on {theirs}, not on this model {model_name(model_dir)} (weights {here[:12]}); "
            f"collecting on a base and pruning its fine-tune is legitimate — check it is what you meant.")


def common(provenances: Sequence[dict]) -> dict:
    """The fields every one of ``provenances`` records with the same value (what a merge of their files keeps)."""
    if not provenances:
        return {}
    first, rest = provenances[0], provenances[1:]
    return {k: v for k, v in first.items() if all(p.get(k) == v for p in rest)}


__all__ = ["FIELDS", "MAX_SAMPLED", "SAMPLE_BYTES", "collected_on", "common", "fingerprint", "mismatch",
           "model_name"]
