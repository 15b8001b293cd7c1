"""Data-parallel work under ``mlx.launch``: which samples each rank takes, and summing what the ranks counted.

Launched by MLX's own launcher (``mlx.launch --backend ring -n 2 …`` on one machine; ``--hosts`` / ``--hostfile``
with ring, MPI, JACCL or NCCL between machines), ``mx.distributed.init()`` gives every process its rank; run
without it, the group has one member and everything here is a no-op. Each rank takes every ``size``-th sample of
the length-sorted list (so ranks get about the same number of tokens), accumulates its own float64 saliency
statistics, and :func:`reduce_saliency` sums them across ranks (``max_activation_norm``: the maximum): the
float64 bits are gathered (any backend, NCCL included) and added in rank order, so counts stay exact and sums
differ from one process only by float64 rounding order. Rank 0 alone writes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    group: object | None  # mx.distributed.Group, None for a single process

    @property
    def writer(self) -> bool:
        """Whether this process writes outputs (rank 0)."""
        return self.rank == 0


def world() -> World:
    """This process's place in an ``mlx.launch`` run (rank 0 of 1 when not launched)."""
    if not mx.distributed.is_available():
        return World(0, 1, None)
    group = mx.distributed.init()
    return World(group.rank(), group.size(), group if group.size() > 1 else None)


def my_share(samples: Sequence[Sequence[int]], w: World) -> list:
    """The samples rank ``w.rank`` handles: every ``size``-th of them sorted by length (longest first; ties by
    position), so all ranks get about the same number of tokens. The shares partition ``samples``."""
    if w.size == 1:
        return list(samples)
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]), i))
    return [samples[i] for i in order[w.rank::w.size]]


def shared_seed(seed: int | None, w: World) -> int | None:
    """The sample-subset seed every rank uses: the given one, or (None) one drawn by rank 0 and sent to all —
    ranks drawing their own subsets would not split (or, split by layers, not even feed) the same samples."""
    if seed is not None or w.group is None:
        return seed
    import secrets

    return int(gather({"seed": np.array([secrets.randbelow(2**31)], dtype=np.float64)}, w)[0]["seed"][0])


def gather(arrays: dict[str, np.ndarray], w: World) -> list[dict[str, np.ndarray]]:
    """Every rank's float64 ``arrays`` (same keys and shapes on every rank), in rank order. The bytes travel, not
    the values: one ``all_gather`` of the float64 bits as uint32 (every backend carries uint32; NCCL and GPUs have
    no float64), so what each rank receives is exactly what the others had."""
    if w.group is None:
        return [{k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()}]
    flat = np.ascontiguousarray(np.concatenate([np.asarray(arrays[k], dtype=np.float64).reshape(-1) for k in arrays]))
    x = mx.array(flat.view(np.uint32))
    try:  # the default stream (a GPU's, for NCCL); the CPU stream where that backend wants it
        out = mx.distributed.all_gather(x, group=w.group)
        mx.eval(out)
    except (RuntimeError, ValueError):
        out = mx.distributed.all_gather(x, group=w.group, stream=mx.cpu)
        mx.eval(out)
    ranks = np.array(out, dtype=np.uint32).reshape(w.size, -1).view(np.float64)
    result = []
    for row in ranks:
        one, at = {}, 0
        for k, v in arrays.items():
            n = np.asarray(v).size
            one[k] = row[at:at + n].reshape(np.shape(v))
            at += n
        result.append(one)
    return result


def reduce_saliency(acc, w: World, *, same_tokens: bool = False):
    """The :class:`~mlx_fun.observe.saliency.SaliencyAccumulator` of all ranks: rank 0's, then each other rank's added
    with :meth:`~mlx_fun.observe.saliency.SaliencyAccumulator.add` (sums; the maximum for max_activation_norm) in rank
    order, so every rank returns the same float64 result. The token count is summed too, unless every rank fed
    the same tokens (``same_tokens``: a model split by layers)."""
    from .saliency import ARRAY_KEYS, SaliencyAccumulator

    if w.group is None:
        return acc
    mine = {k: getattr(acc, k) for k in ARRAY_KEYS}
    mine["total_tokens"] = np.array([acc.total_tokens], dtype=np.float64)
    ranks = []
    for arrays in gather(mine, w):
        one = SaliencyAccumulator(acc.num_layers, acc.num_experts, model_type=acc.model_type,
                                  moe_layer_indices=acc.moe_layer_indices, top_k=acc.top_k)
        for k in ARRAY_KEYS:
            setattr(one, k, arrays[k])
        one.total_tokens = int(arrays["total_tokens"][0])
        ranks.append(one)
    total = ranks[0]
    for other in ranks[1:]:
        total.add(other)
    if same_tokens:
        total.total_tokens = acc.total_tokens
    return total


# ------------------------------------------------------------------------------------ a model split by layers
def check_pipeline(config: dict, w: World) -> None:
    """A one-line ``UserError`` unless ``w``'s ranks can split the model of ``config`` by layers: two or more
    ranks, and no more ranks than decoder layers (mlx-lm would leave a rank without a layer and every rank fails)."""
    from ..errors import UserError, param

    if w.size < 2:
        raise UserError(f"{param('pipeline')} splits the model's layers across the ranks of mlx.launch; start it "
                        "with two or more ranks (mlx.launch --backend ring -n 2 -- mlx-fun collect ... --pipeline).")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    if isinstance(layers, int) and not isinstance(layers, bool) and w.size > layers:
        raise UserError(f"{param('pipeline')} gives every rank at least one decoder layer, and this model has "
                        f"{layers} for {w.size} ranks; launch at most {layers} (mlx.launch -n {layers} ...), or "
                        f"collect data-parallel without {param('pipeline')}.")


def pipeline_load(model_path, w: World):
    """mlx-lm's ``sharded_load`` with pipeline sharding over the launched ranks: each rank loads and runs only its
    decoder layers (rank 0 the last ones). Returns ``(model, tokenizer, config, adapter, global_moe_layers,
    local_to_global)``: the adapter sees this rank's MoE layers; ``local_to_global[p]`` is the position of its
    ``p``-th one among the whole model's MoE layers (``global_moe_layers``, decoder indices). The job checks the
    ranks first (:func:`check_pipeline`)."""
    from mlx_lm.utils import sharded_load

    from ..adapters import get_adapter
    from ..errors import UserError, param
    from ..model.io import load_model

    full, tokenizer, config = load_model(model_path, lazy=True)  # no weights read: the layout, and the tokenizer
    global_layers = get_adapter(full, config).moe_layers()  # exactly as an unsharded collect loads it
    del full
    try:  # sharded_load synchronizes the ranks with a collective on the CPU stream, which NCCL cannot run
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=w.group))
    except RuntimeError:
        raise UserError(f"{param('pipeline')} needs a backend whose collectives run on the CPU (ring, MPI, JACCL): "
                        "mlx-lm's sharded_load synchronizes the ranks there and NCCL cannot; launch with --backend "
                        "ring (its send/recv carries GPU arrays too), or collect data-parallel under NCCL without "
                        f"{param('pipeline')}.") from None
    try:
        model, _ = sharded_load(str(model_path), pipeline_group=w.group)
    except ValueError as e:
        if "does not support pipelining" not in str(e):
            raise
        raise UserError(f"model_type '{config.get('model_type')}' has no pipeline split in mlx-lm (its model class "
                        f"has no pipeline()); collect it data-parallel (without {param('pipeline')}) on machines "
                        f"that each hold it.") from None
    adapter = get_adapter(model, config)
    index = {id(layer): i for i, layer in enumerate(model.model.layers) if layer is not None}
    local = [index[id(adapter.decoder_layers()[i])] for i in adapter.moe_layers()]
    return model, tokenizer, config, adapter, global_layers, [global_layers.index(i) for i in local]


def globalize(acc, global_layers: list[int], local_to_global: list[int]):
    """This rank's accumulator (its MoE layers only) as one of the whole model (zeros for the other ranks'
    layers): summed over the ranks it is the unsharded file, bit for bit (x + 0 = x)."""
    from .saliency import ARRAY_KEYS, SaliencyAccumulator

    out = SaliencyAccumulator(len(global_layers), acc.num_experts, model_type=acc.model_type,
                              moe_layer_indices=global_layers, top_k=acc.top_k)
    for k in ARRAY_KEYS:
        getattr(out, k)[local_to_global] = getattr(acc, k)
    out.total_tokens = acc.total_tokens
    return out
