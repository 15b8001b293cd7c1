#!/usr/bin/env python3
"""The reference side of ``scripts/parity/abliterate.py``: heretic's own weight edit (``Model.abliterate``, then
``get_merged_model``) with a given direction per layer, in a PyTorch venv with heretic's dependencies (no MLX).

    VENV/bin/python scripts/parity/abliterate_reference.py --reference HERETIC_TREE --model HF_DIR \
        --directions DIRS.npy --layers 0,1,2,3 --weight 1.0 [--row-normalization none] --out OUT.safetensors

heretic is imported from ``HERETIC_TREE/src`` as it is. Its ``Settings`` are built in a scratch working directory
with no command line (they read ``sys.argv`` and ``config.toml``): the model on the CPU in float32 and the given
row normalization. ``DIRS.npy`` is (layers, hidden): row ``i`` becomes heretic's ``residual_directions[i + 1]``
(its row 0 is the embeddings', unused here) and ``direction_index=None`` (each layer its own row). Every
component gets ``max_weight = min_weight = weight`` centred on the chosen layers, so each chosen layer is edited
at ``weight`` and no other. OUT holds every weight heretic's merge changed, under transformers' names, and JSON
metadata with the components it found per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--directions", required=True, type=Path)
    ap.add_argument("--layers", required=True)
    ap.add_argument("--weight", type=float, default=1.0)
    ap.add_argument("--row-normalization", default="none", choices=("none", "pre", "full"))
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)  # on a shared 2-core machine more threads spin against each other (40x slower)
    sys.path.insert(0, str((args.reference / "src").resolve()))
    model_dir = str(Path(args.model).resolve())
    out = args.out.resolve()
    os.chdir(tempfile.mkdtemp(prefix="heretic-"))  # no config.toml here
    sys.argv = sys.argv[:1]  # heretic's Settings parse the command line
    from heretic.config import Settings
    from heretic.model import AbliterationParameters, Model
    from safetensors.torch import save_file
    import transformers

    settings = Settings(model=model_dir, dtypes=["float32"], device_map="cpu", seed=0,
                        row_normalization=args.row_normalization)
    model = Model(settings)
    before = {k.replace(".base_layer", ""): v.detach().clone()
              for k, v in model.model.base_model.model.state_dict().items() if "lora_" not in k}
    layers = [int(x) for x in args.layers.split(",")]
    dirs = torch.from_numpy(np.load(args.directions).astype(np.float32))
    residual = torch.zeros(dirs.shape[0] + 1, dirs.shape[1])
    residual[1:] = dirs
    lo, hi = min(layers), max(layers)
    if layers != list(range(lo, hi + 1)):
        raise SystemExit("--layers must be a contiguous range (heretic weights layers by distance from a centre)")
    params = AbliterationParameters(max_weight=args.weight, max_weight_position=(lo + hi) / 2,
                                    min_weight=args.weight, min_weight_distance=max((hi - lo) / 2, 1e-9))
    components = {i: sorted(model.get_layer_modules(i)) for i in range(len(model.get_layers()))}
    counts = {i: {c: len(m) for c, m in model.get_layer_modules(i).items()} for i in components}
    model.abliterate(residual, None, {c: params for c in model.get_abliterable_components()})
    merged = model.get_merged_model().state_dict()
    changed = {}
    for name, value in merged.items():
        old = before.get(name)
        if old is not None and old.shape == value.shape and not torch.equal(old, value):
            changed[name] = value.detach().float().contiguous()
    save_file(changed, str(out), metadata={"components": json.dumps(counts), "transformers": transformers.__version__,
                                           "torch": torch.__version__})
    print(f"heretic: {len(changed)} tensors changed; components per layer {counts[layers[0]]}; "
          f"transformers {transformers.__version__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
