#!/usr/bin/env python3
"""heretic parity: heretic's abliteration weight edit with OUR direction on the same layers, beside `mlx-fun
abliterate`'s edit, tensor by tensor.

    python -m scripts.parity.abliterate --reference /work/refs/heretic --python VENV/bin/python \
        [--model data/tiny-moe-chat] [--weight 1.0] [--row-normalization none]

The model is exported to transformers' layout (:mod:`scripts.tools.export_transformers`, float32); `mlx-fun
abliterate` runs on that export (mlx_lm reads it back) with one round, one direction (``--direction single
--phrasings 1 --rounds 1 --layers all --weight W``) and writes its model; its direction (one per layer, the
single direction repeated) goes to heretic's ``Model.abliterate`` (:mod:`scripts.parity.abliterate_reference`,
in ``--python``) on the same export. Printed per tensor heretic changed: the largest absolute difference between
heretic's merged weight and ours (routed experts: over all experts), against the size of the edit itself; then
the writers one side changed and the other did not (heretic: none of the token embedding, and on transformers 5
none of qwen3_moe's routed experts, whose fused module it cannot iterate).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, type=Path, help="p-e-w/heretic's tree")
    ap.add_argument("--python", required=True, help="a Python with torch, transformers and heretic's dependencies")
    ap.add_argument("--model", default=str(ROOT / "data" / "tiny-moe-chat"))
    ap.add_argument("--data", default=str(ROOT / "data" / "safety"))
    ap.add_argument("--weight", type=float, default=1.0)
    ap.add_argument("--row-normalization", default="none", choices=("none", "pre", "full"),
                    help="heretic's option (its default is full; ours is none's rule)")
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    from safetensors.numpy import load_file

    from mlx_fun import jobs
    from mlx_fun.datasets.calibration import Calibration
    from mlx_fun.rewrite.abliterate_options import Estimate, Evaluation, Projection
    from scripts.parity.common import exported

    work = Path(args.work or tempfile.mkdtemp(prefix="parity-abliterate-"))
    work.mkdir(parents=True, exist_ok=True)
    hf = exported(args.model, work)
    data = Path(args.data)
    res = jobs.abliterate.run(
        model=hf, harmful_dataset=data / "harmful_train.jsonl", benign_dataset=data / "benign_train.jsonl",
        output=work / "ours", force=True, estimate=Estimate(direction="single", phrasings=1, rounds=1),
        projection=Projection(layers="all", weight=args.weight), evaluation=Evaluation(eval_samples=16),
        calibration=Calibration(max_samples=64, seed=0, batch_size=4))
    dirs = np.asarray(res.directions, dtype=np.float32)
    np.save(work / "directions.npy", dirs)
    print(f"ours: layers {res.layers}, weight {res.weight}, direction layer {res.direction_layer}; "
          f"modified {sum(len(v) for v in res.modified.values())} writers ({', '.join(map(str, res.modified))})")
    out = work / "heretic.safetensors"
    cmd = [args.python, str(ROOT / "scripts" / "parity" / "abliterate_reference.py"), "--reference",
           str(args.reference), "--model", str(hf), "--directions", str(work / "directions.npy"), "--layers",
           ",".join(map(str, res.layers)), "--weight", str(args.weight), "--row-normalization",
           args.row_normalization, "--out", str(out)]
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        sys.exit(f"Error: the reference side failed: {' '.join(cmd)}")
    theirs = load_file(str(out))
    original = load_file(str(hf / "model.safetensors"))
    ours = {}
    for f in sorted((work / "ours").glob("*.safetensors")):
        ours.update(load_file(str(f)))
    compare(theirs, ours, original)
    return 0


def ours_tensor(ours: dict, name: str) -> np.ndarray | None:
    """Our (mlx-lm layout) tensor for transformers' ``name``: a per-expert weight is a row of the stacked one."""
    if name in ours:
        return ours[name]
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
        return None
    e, proj = tail.split(".", 1)
    stacked = ours.get(f"{head}.mlp.switch_mlp.{proj}")
    return None if stacked is None else stacked[int(e)]


def compare(theirs: dict, ours: dict, original: dict) -> None:
    groups: dict[str, list[tuple[float, float]]] = {}
    for name, t in sorted(theirs.items()):
        o = ours_tensor(ours, name)
        if o is None:
            print(f"  {name}: not in our output")
            continue
        key = name.split(".mlp.experts.")[0] + ".mlp.experts.*.down_proj" if ".mlp.experts." in name else name
        edit = float(np.max(np.abs(t - original[name])))
        groups.setdefault(key, []).append((float(np.max(np.abs(t.astype(np.float64) - o))), edit))
    print(f"\n{'tensor (heretic changed)':<52} {'max |heretic - ours|':>20} {'max |edit|':>11}")
    worst = 0.0
    for key, vals in groups.items():
        d, e = max(v[0] for v in vals), max(v[1] for v in vals)
        worst = max(worst, d)
        print(f"{key + (f' ({len(vals)} experts)' if len(vals) > 1 else ''):<52} {d:>20.3e} {e:>11.3e}")
    covered = {n for n in theirs} | {n.split(".mlp.experts.")[0] + ".mlp.switch_mlp.down_proj.weight"
                                     for n in theirs if ".mlp.experts." in n}
    only_ours = [n for n in sorted(ours) if n in original and n not in covered
                 and not np.array_equal(ours[n], original[n])]
    stacked = {n.split(".mlp.experts.")[0] + ".mlp.switch_mlp.down_proj.weight" for n in original if
               ".mlp.experts." in n}
    only_ours += [n for n in sorted(stacked) if n not in covered and n in ours]
    print(f"changed by ours only: {', '.join(only_ours) or 'none'}")
    verdict = "SAME to rounding" if worst < 1e-5 else "DIFFERENT"
    print(f"verdict: heretic's edit and ours on the tensors heretic changed: {verdict} (max |diff| {worst:.3e})")


if __name__ == "__main__":
    sys.exit(main())
