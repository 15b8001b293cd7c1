#!/usr/bin/env python3
"""The reference side of ``scripts/parity/steer.py``: SteerMoE's and SAFEx's own code on the exported model, in a
PyTorch + transformers venv (no MLX here; ``steer.py`` starts it as a subprocess).

    VENV/bin/python scripts/parity/steer_reference.py --steermoe DIR --safex DIR --model HF_DIR --job JOB.json \
        --out OUT.json

Both references run on vLLM, which needs a GPU; their code is read from the reference directories as it is and
run on transformers' Qwen3MoeForCausalLM instead (its router is the same: softmax, top-k, renormalised over the
k chosen when ``norm_topk_prob``):

- SteerMoE (adobe-research/SteerMoE): the detection cells of ``custom_steering.ipynb`` (``get_router_prob_n2``,
  the token gathering, ``calc_risk_diff``) on the router logits of the same token ids, each set's whole prompt as
  its target span; ``src/utils.py:steer_moe`` (its expert choice, given the pickle the detection wrote) and the
  routing rule of ``src/modeling_vllm/qwen3_moe.py`` (the block between its ``### ADDED BY MOHSEN`` markers: the
  log-softmax with activated experts at the token's max + 0.01 and deactivated ones at its min - 0.01), applied to
  the output of every layer's ``mlp.gate``.
- SAFEx (Bearisbug/SAFEx): ``trace.py``'s ``_install`` / ``_reset`` / ``compute_avg`` (its gate hook: softmax,
  top-k, per layer x expert counts and mean probabilities of the prompt tokens), on the same prompts.

JOB.json: ``{"sets": {"harmful": [[ids]], "benign": [[ids]]}, "eval": [[ids]], "max_tokens": 16,
"settings": [{"name", "kind": "steermoe", "pos", "neg", "reverse"} | {"name", "kind": "manual", "activate":
{layer: [e]}, "deactivate": {...}}], "logit_prompts": [[ids]]}``. OUT.json: the detection table, SAFEx's counts,
and per setting the experts steered, the greedy reply ids and the last-position log-probs of ``logit_prompts``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch


def function_source(path: Path, name: str) -> str:
    """The source of top-level function ``name`` of ``path`` (the file is parsed, not run: trace.py runs vLLM at
    import)."""
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node)
    raise SystemExit(f"{path} has no function {name}")


def marked_block(path: Path, begin: str = "### ADDED BY MOHSEN {", end: str = "### ADDED BY MOHSEN }") -> str:
    """The lines between the markers inside ``Qwen3MoeSparseMoeBlock.forward``, dedented: SteerMoE's routing
    change."""
    import textwrap

    text = path.read_text()
    a = text.index(begin, text.index("    def forward", text.index("class Qwen3MoeSparseMoeBlock")))
    a = text.index("\n", a) + 1
    b = text.rindex("\n", 0, text.index(end, a))
    return textwrap.dedent(text[a:b])


def notebook_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


class Steered:
    """Every layer's ``mlp.gate`` output replaced by SteerMoE's block, run as its source says, with this layer's
    ``moe_manual_args`` (what ``update_moe_manual_args`` hands each layer) and ``layer_idx``."""

    def __init__(self, model, block: str):
        self.code = compile(block, "SteerMoE qwen3_moe.py (ADDED BY MOHSEN)", "exec")
        cfg = model.config
        self.args = {"moe_manual_weights": torch.zeros(cfg.num_hidden_layers, cfg.num_experts)}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        outer = self

        class Layer:  # the ``self`` the block reads: its moe_manual_args and layer_idx
            layer_idx = i
            moe_manual_args = outer.args

        def hook(_module, _inputs, router_logits):
            scope = {"torch": torch, "self": Layer, "router_logits": router_logits}
            exec(self.code, scope)
            return scope["router_logits"]

        return hook

    def update_moe_manual_args(self, moe_manual_args):  # what steer_moe's set_moe calls on the model
        self.args.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in moe_manual_args.items()})

    def set_weights(self, weights: torch.Tensor):
        self.args["moe_manual_weights"] = weights


def router_logits(model, ids: list[int]) -> np.ndarray:
    """(layers, tokens, experts) router logits of one prompt, float16 as the notebook's ``get_routings`` keeps
    them."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return np.stack([r.float().numpy() for r in out.router_logits]).astype(np.float16)


def steermoe_detect(model, nb: Path, harmful, benign, top_k: int, workdir: Path) -> pd.DataFrame:
    """The notebook's cells 11-12 (detection) on the two sets, messages_0 = harmful, messages_1 = benign, each
    prompt's whole token list as its target."""
    def rows(sets, key):
        return pd.DataFrame([{"router_logits": router_logits(model, ids), "prompt_token_ids": list(ids),
                              "prompt_tokens": [str(t) for t in ids], f"{key}_target": {"token_ids": list(ids)}}
                             for ids in sets])

    dfs = {"messages_0": rows(harmful, "messages_0"), "messages_1": rows(benign, "messages_1")}
    for d in dfs.values():
        d.attrs = {"num_experts_per_tok": str(top_k), "model_name": "tiny", "dataset_name": "safety"}
    cells = notebook_cells(nb)
    detect = [c for c in cells if "def get_router_prob_n2" in c] + [c for c in cells if "def calc_risk_diff" in c]
    assert len(detect) == 2, "custom_steering.ipynb: detection cells not found"
    from tqdm import tqdm

    scope = {"dfs": dfs, "np": np, "pd": pd, "torch": torch, "tqdm": lambda x, **k: x}
    cwd = os.getcwd()
    os.chdir(workdir)  # cell 12 pickles its table into the working directory
    try:
        for cell in detect:
            exec(compile(cell, str(nb), "exec"), scope)
    finally:
        os.chdir(cwd)
    del tqdm
    return scope["df"]


def safex_counts(model, trace: Path, prompts, L: int, E: int, TK: int) -> dict:
    """trace.py's gate hooks (``_install``), reset per prompt (``_reset``), summed over ``prompts``; every token
    is a prompt token (one forward each, no generation)."""
    import re

    scope = {"torch": torch, "np": np, "L": L, "E": E, "TK": TK, "PAT": re.compile(r"\.mlp\.gate$")}
    for name in ("_install", "_reset", "compute_avg"):
        exec(function_source(trace, name), scope)

    class Runner:
        model = None

    class Exe:
        device = "cpu"
        model_runner = Runner

    Runner.model = model
    n = scope["_install"](Exe)
    assert n == L, f"trace.py hooked {n} gates, the model has {L} layers"
    usage, sums = np.zeros((L, E)), np.zeros((L, E))
    for ids in prompts:
        scope["_reset"](Exe, len(ids))
        with torch.no_grad():
            model(torch.tensor([ids]))
        usage += Exe._trace_in.numpy()
        sums += Exe._sum_in.numpy()
    for m in model.modules():  # drop trace.py's hooks
        m._forward_hooks.clear()
    return {"input_expert_usage": usage.tolist(), "input_avg_probs": scope["compute_avg"](usage, sums)}


def steermoe_choice(utils_dir: Path, pickle: Path, steered: Steered, model, *, pos: int, neg: int, reverse: bool):
    """``steer_moe`` of the reference's src/utils.py on a stand-in for vLLM's LLM (its ``collective_rpc`` runs the
    function on a worker whose model is ``steered``); its ``torch.zeros(..., device="cuda")`` is made on the CPU."""
    sys.path.insert(0, str(utils_dir))
    from src.utils import steer_moe

    class Model:
        config = model.config
        update_moe_manual_args = staticmethod(steered.update_moe_manual_args)

    class Runner:
        pass

    Runner.model = Model

    class Worker:
        model_runner = Runner

    class LLM:
        @staticmethod
        def collective_rpc(fn):
            return [fn(Worker)]

    zeros = torch.zeros
    torch.zeros = lambda *a, device=None, **k: zeros(*a, **k)
    try:
        steer_moe(LLM, str(pickle), pos, neg, reverse_effect=reverse, strategy="risk_diff")
    finally:
        torch.zeros = zeros
    w = steered.args["moe_manual_weights"]
    return {"activate": {str(i): np.flatnonzero(w[i].numpy() > 0).tolist() for i in range(w.shape[0])},
            "deactivate": {str(i): np.flatnonzero(w[i].numpy() < 0).tolist() for i in range(w.shape[0])}}


def manual_weights(setting: dict, L: int, E: int) -> torch.Tensor:
    w = torch.zeros(L, E)
    for key, sign in (("activate", 1.0), ("deactivate", -1.0)):
        for layer, experts in setting.get(key, {}).items():
            w[int(layer), list(experts)] = sign
    return w


def greedy(model, prompts, max_tokens: int, eos: int, batch: int = 16) -> list[list[int]]:
    """Greedy replies (left-padded batches), cut at the first EOS."""
    out = []
    for a in range(0, len(prompts), batch):
        chunk = prompts[a:a + batch]
        n = max(map(len, chunk))
        ids = torch.tensor([[0] * (n - len(p)) + list(p) for p in chunk])
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=eos)
        for row in gen[:, n:].tolist():
            out.append(row[:row.index(eos)] if eos in row else row)
    return out


def last_logprobs(model, prompts) -> list[list[float]]:
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, -1].float(), -1).tolist() for p in prompts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steermoe", required=True, type=Path)
    ap.add_argument("--safex", required=True, type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--job", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)  # on a shared 2-core machine more threads spin against each other (40x slower)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    t0 = time.time()
    job = json.loads(args.job.read_text())
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    cfg = model.config
    L, E, TK = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    harmful, benign = job["sets"]["harmful"], job["sets"]["benign"]
    work = Path(tempfile.mkdtemp(prefix="steermoe-"))
    table = steermoe_detect(model, args.steermoe / "custom_steering.ipynb", harmful, benign, TK, work)
    pickle = next(work.glob("activations_*.pkl"))
    print(f"reference: SteerMoE detection done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    safex = {k: safex_counts(model, args.safex / "trace.py", v, L, E, TK) for k, v in job["sets"].items()}
    print(f"reference: SAFEx trace done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    steered = Steered(model, marked_block(args.steermoe / "src/modeling_vllm/qwen3_moe.py"))
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
    results = []
    for s in job["settings"]:
        if s["kind"] == "steermoe":
            chosen = steermoe_choice(args.steermoe, pickle, steered, model, pos=s["pos"], neg=s["neg"],
                                     reverse=bool(s["reverse"]))
        else:
            steered.set_weights(manual_weights(s, L, E))
            chosen = {"activate": s.get("activate", {}), "deactivate": s.get("deactivate", {})}
        replies = greedy(model, job["eval"], job["max_tokens"], eos)
        results.append({"name": s["name"], **chosen, "replies": replies,
                        "logprobs": last_logprobs(model, job["logit_prompts"])})
        print(f"reference: {s['name']} done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    cols = ["layer", "expert", "a1", "a2", "d1", "d2", "risk_diff"]
    args.out.write_text(json.dumps({
        "steermoe_table": table[cols].astype(float).values.tolist(), "steermoe_columns": cols,
        "safex": safex, "settings": results, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
