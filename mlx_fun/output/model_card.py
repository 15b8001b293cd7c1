"""The model card (``README.md``) of every model mlx-fun writes, like the one ``mlx_lm.convert`` writes.

A rewritten model must not keep its source's card, which describes a model it no longer is. :func:`card` builds
the new one from the job's metadata file (``reap_metadata.json``, ``ream_metadata.json``,
``abliteration_metadata.json``, ``amplification_metadata.json``, ``quantize_metadata.json``): YAML front matter
(``library_name: mlx``, ``base_model`` (the repo id, or a local source's directory name), ``tags: [mlx, mlx-fun,
<method>]``, and the source card's ``license`` / ``pipeline_tag``), what mlx-fun did with which settings (and the
LoRA adapter fused into the source first, by its directory's name, when the metadata names one: the full path stays
in the metadata file), the numbers the run measured, and how to load the output with mlx-lm. Nothing is fetched: the
source card is read from the source directory, if it has one.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: front-matter keys copied from the source's card (with ``pipeline_tag``, what the model is for)
LICENSE_KEYS = ("license", "license_name", "license_link")
#: the most of a source card read for its front matter (which sits at the top)
MAX_CARD_BYTES = 1 << 20

_FRONT = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)


def source_front_matter(source: str | os.PathLike) -> dict:
    """The YAML front matter of ``source``'s ``README.md``; ``{}`` when it has no card, no front matter, or one
    that is not a YAML mapping (a card is documentation: it never stops a job)."""
    import yaml

    path = Path(source) / "README.md"
    if not path.is_file():  # also a FIFO / device named README.md: not read
        return {}
    try:
        with path.open("rb") as f:
            text = f.read(MAX_CARD_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return {}
    match = _FRONT.match(text.lstrip("\ufeff"))
    if not match:
        return {}
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def base_model(source: str | os.PathLike) -> tuple[str, dict | None]:
    """``(base_model, provenance)`` of a model read from ``source``: the Hugging Face repo id and its
    ``{"repo_id", "revision", "commit"}`` when :func:`mlx_fun.model.hub.source` knows where the directory came from (a
    repo id the job resolved, a snapshot of the Hugging Face cache), else the local directory's name and ``None`` (a
    card is published: the full path, which names the machine's directories, stays in the metadata JSON)."""
    from ..model.hub import short_name, source as hub_source

    found = hub_source(source)
    return short_name(source), (found if found and found.get("repo_id") else None)


def _arrow(before, after) -> str | None:
    if after is None:
        return None
    return str(after) if before is None else f"{before} → {after}"


def _layers(layers) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2, 5"``."""
    out, run = [], []
    for i in sorted(int(x) for x in layers):
        if run and i != run[-1] + 1:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        run.append(i)
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out) or "none"


def _pct(x) -> str | None:
    return None if x is None else f"{x:.1%}"


def _prune(m: dict) -> list[tuple[str, object]]:
    keep = m.get("keep_map") or {}
    after = m.get("pruned_num_experts") or (len(next(iter(keep.values()))) if keep else None)
    selection = m.get("metric")
    if m.get("strategy"):
        selection = f"{selection}, {m['strategy']}" + (", model-wide" if m.get("model_wide") else "")
    return [("routed experts per MoE layer", _arrow(m.get("original_num_experts"), after)),
            ("MoE layers pruned", len(keep) or None), ("experts removed per layer", m.get("n_prune")),
            ("selection (metric, strategy)", selection), ("saliency / expert list", m.get("source"))]


def _merge(m: dict) -> list[tuple[str, object]]:
    tokens = m.get("calibration_tokens")
    return [("routed experts per MoE layer", _arrow(m.get("original_num_experts"), m.get("merged_num_experts"))),
            ("MoE layers merged", len(m.get("centroid_map") or {}) or None), ("centroid metric", m.get("metric")),
            ("similarity / alignment", "{} / {}".format(m["similarity_mode"], m["alignment"])
             if "similarity_mode" in m and "alignment" in m else None),
            ("max group size", m.get("max_group_size")),
            ("calibration", None if tokens is None else f"{m.get('calibration_samples')} samples, {tokens:,} tokens"
             + (f" of {m['dataset']}" if m.get("dataset") else "")),
            ("saliency / expert list", m.get("source")), ("seed", m.get("seed"))]


def _abliterate(m: dict) -> list[tuple[str, object]]:
    ev = m.get("evaluation") or {}
    before, after = ev.get("before") or {}, ev.get("after") or {}
    where = None
    if ev:
        where = (f"{ev.get('harmful_prompts')} harmful / {ev.get('benign_prompts')} benign "
                 f"{'held-out' if ev.get('held_out') else 'capture'} prompts, {ev.get('reply_tokens')}-token replies")
    direction = m.get("direction")
    if direction == "single" and m.get("direction_layer") is not None:
        direction = f"single (from layer {m['direction_layer']})"
    kl = after.get("benign_kl")
    return [("abliterated layers", None if m.get("abliterated_layers") is None else _layers(m["abliterated_layers"])),
            ("weight", m.get("weight")), ("direction", direction), ("target", m.get("target")),
            ("rounds", None if m.get("rounds") is None else len(m["rounds"])),
            ("harmful refusal", _arrow(_pct(before.get("harmful_refusal")), _pct(after.get("harmful_refusal")))),
            ("benign refusal", _arrow(_pct(before.get("benign_refusal")), _pct(after.get("benign_refusal")))),
            ("benign first-token KL vs. the source", None if kl is None else f"{kl:.4f}"),
            ("measured on", where), ("KL bound (--max-kl)", _bound(ev.get("kl_bound")))]


def _bound(b: dict | None) -> str | None:
    """The KL ``--max-kl`` bounds, on the prompts it was measured on (held out of the directions, or not)."""
    return None if not b else f"{b['held_out_kl']:.4f} ({b['on']}; bound {b['max_kl']:g})"


def _amplify(m: dict) -> list[tuple[str, object]]:
    boost = m.get("boost") or {}
    n = sum(len(v) for v in boost.values())
    return [("domain", m.get("domain_name")), ("domain report", m.get("domain_map")), ("scale", m.get("scale")),
            ("threshold", m.get("threshold")), ("router bias", m.get("target")),
            ("experts boosted", f"{n} in {len(boost)} MoE layer(s)" if "boost" in m else None)]


def _quantize(m: dict) -> list[tuple[str, object]]:
    r = m.get("recipe") or {}
    cold = r.get("cold_layers") or []
    floats = m.get("float_modules") or []
    return [("routed experts", r.get("experts")),
            ("dense (attention, shared experts, embeddings, head)", r.get("dense")),
            ("router", r.get("router")),
            ("coldest MoE layers' experts", f"{r['cold_experts']} (layers {_layers(cold)})" if cold else None),
            ("bits per weight", m.get("bits_per_weight")),
            ("left in float (width not a multiple of the group size)", len(floats) or None)]


#: metadata file → (tag, what mlx-fun did, the rows of measured numbers and settings)
METHODS = {
    "reap_metadata.json": ("prune", "pruned its routed experts with REAP (`mlx-fun prune`): the least salient "
                           "experts of every MoE layer were removed, router rows included", _prune),
    "ream_metadata.json": ("merge", "merged its routed experts with REAM (`mlx-fun merge`): the least salient "
                           "experts were folded into the most salient ones (the centroids)", _merge),
    "abliteration_metadata.json": ("abliterate", "abliterated it (`mlx-fun abliterate`): the refusal directions "
                                   "were removed from what the chosen decoder layers write", _abliterate),
    "amplification_metadata.json": ("amplify", "amplified a domain's experts (`mlx-fun amplify`): their router "
                                    "bias was raised, so they are chosen more often", _amplify),
    "quantize_metadata.json": ("quantize", "quantized it with an MoE-aware mixed-precision recipe "
                               "(`mlx-fun quantize`)", _quantize),
}


def card(metadata: dict | None, *, base: str, output: str, source_card: dict | None = None,
         size_before: int | None = None, size_after: int | None = None, provenance: dict | None = None) -> str:
    """The ``README.md`` text of a model written from ``base`` (a repo id, with its ``provenance`` from
    :func:`base_model`, or a path) to ``output`` (the name shown in the mlx-lm snippet), described by the first
    metadata file it knows in ``metadata`` (file name → object)."""
    import yaml

    from .. import __version__
    from ..core.writer import fmt_bytes

    source_card = source_card or {}
    found = next(((name, METHODS[name], obj) for name, obj in (metadata or {}).items()
                  if name in METHODS and isinstance(obj, dict)), None)
    front = {k: source_card[k] for k in LICENSE_KEYS if k in source_card}
    front.update(library_name="mlx", base_model=str(base))
    front["pipeline_tag"] = source_card.get("pipeline_tag", "text-generation")
    front["tags"] = ["mlx", "mlx-fun"] + ([found[1][0]] if found else [])
    head = yaml.safe_dump(front, sort_keys=False, allow_unicode=True, width=1000)
    did = found[1][1] if found else "rewrote it"
    origin = f"`{base}`"
    if provenance:
        at = ", ".join(f"{k} {str(provenance[k])[:12]}" for k in ("revision", "commit") if provenance.get(k))
        origin = f"[{base}](https://huggingface.co/{base})" + (f" ({at})" if at else "")
    lora = found[2].get("adapter") if found else None
    if isinstance(lora, dict) and lora.get("path"):  # mlx_fun.model.lora.describe: fused before the rewrite
        origin += f" with the {lora.get('fine_tune_type', 'lora')} adapter `{Path(lora['path']).name}` fused into it"
    lines = [f"---\n{head}---", "", f"# {Path(output).name or output}", "",
             f"This model was made from {origin} by mlx-fun {__version__}, which {did}."]
    if isinstance(source_card.get("base_model"), (str, list)):
        lineage = source_card["base_model"]
        lineage = ", ".join(map(str, lineage)) if isinstance(lineage, list) else lineage
        lines.append(f"The source's own card names its base model: `{lineage}`.")
    rows = found[1][2](found[2]) if found else []
    if isinstance(lora, dict) and lora.get("path"):
        rows.append(("adapter fused first (mlx_lm.fuse's arithmetic)", f"{Path(lora['path']).name} (rank "
                     f"{lora.get('rank')}, sha256 {str(lora.get('sha256'))[:12]})"))
    if size_after is not None:
        rows.append(("weights on disk", _arrow(None if size_before is None else fmt_bytes(size_before),
                                              fmt_bytes(size_after))))
    rows = [(k, v) for k, v in rows if v is not None]
    if rows:
        lines += ["", "## What mlx-fun did", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
    if metadata:
        names = ", ".join(f"`{n}`" for n in metadata if n != "README.md")
        if names:
            lines += ["", f"Every setting and per-layer choice is recorded in {names} beside the weights."]
    if "license" in front:
        lines += ["", f"License: `{front['license']}`, as the source model's card states."]
    lines += ["", "## Use with mlx-lm", "", "```bash", "pip install mlx-lm", "```", "", "```python",
              "from mlx_lm import load, generate", "", f"model, tokenizer = load({json.dumps(str(output))})", "",
              'prompt = "hello"', "if tokenizer.chat_template is not None:",
              '    messages = [{"role": "user", "content": prompt}]',
              "    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)", "",
              "response = generate(model, tokenizer, prompt=prompt, verbose=True)", "```", ""]
    return "\n".join(lines)
