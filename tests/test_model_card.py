"""Honest model cards (issue 30 part 4): every rewritten model gets a README.md of its own — base model, what
mlx-fun did with which settings, the measured numbers of its metadata file, the source card's license, how to load
it — instead of the source's card; and it still opens with plain mlx_lm.load."""

from __future__ import annotations

import json
import shutil

import mlx_lm
import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.adapters import get_adapter
from mlx_fun.model.io import load_model
from mlx_fun.output.model_dir import save_model_dir
from mlx_fun.output.model_card import card, source_front_matter
from mlx_fun.rewrite.merge_options import Ream
from mlx_fun.rewrite.quantize import QuantRecipe
from mlx_fun.observe.saliency import SaliencyAccumulator
from mlx_fun.experts.selection import Selection

from .test_cli import SAMPLE

SOURCE_CARD = ("---\nlicense: apache-2.0\npipeline_tag: text-generation\nbase_model: org/original-moe\n"
               "tags: [source-only-tag]\n---\n\n# The source model\n\nSOURCE CARD BODY: trained on everything.\n")


@pytest.fixture(scope="module")
def carded(make_model, tmp_path_factory):
    """``carded(family) -> Path``: a copy of the tiny ``family`` model whose README.md has license front matter."""
    root, made = tmp_path_factory.mktemp("carded"), {}

    def factory(family: str):
        if family not in made:
            made[family] = shutil.copytree(make_model(family), root / family)
            (made[family] / "README.md").write_text(SOURCE_CARD)
        return made[family]

    return factory


def _saliency(src, path):
    model, _, config = load_model(src, lazy=True)
    acc = SaliencyAccumulator.for_adapter(get_adapter(model, config))
    acc.freq[...] = 100
    acc.reap_count[...] = 100
    acc.reap_sum[...] = np.random.default_rng(0).uniform(1, 2, acc.freq.shape)
    acc.total_tokens = 400
    return acc.save(path)


def _card(out, src, tag: str, meta_file: str) -> tuple[str, dict]:
    """The output's card, checked for what every card holds; and the metadata file beside it."""
    text = (out / "README.md").read_text()
    front = text.split("---\n")[1]
    assert "library_name: mlx\n" in front and f"base_model: {src.name}\n" in front, front
    assert str(src) not in text  # a published card names the local directory, not this machine's path to it
    assert f"- mlx\n- mlx-fun\n- {tag}\n" in front and "license: apache-2.0\n" in front, front
    assert "pipeline_tag: text-generation\n" in front and "source-only-tag" not in front
    assert "SOURCE CARD BODY" not in text and "`org/original-moe`" in text  # its own card, the source's lineage
    assert f"`mlx-fun {tag}`" in text and f"`{meta_file}`" in text
    assert f"from mlx_lm import load, generate\n\nmodel, tokenizer = load({json.dumps(str(out))})" in text
    assert "| weights on disk |" in text
    mlx_lm.load(str(out))  # plain mlx-lm opens what the card says it does
    meta = json.loads((out / meta_file).read_text())
    assert meta["base_model"] == {"path": str(src)}  # the full path: in the metadata JSON only
    return text, meta


def test_prune_card(carded, tmp_path):
    src = carded("qwen3_moe")
    out = jobs.prune.run(model=src, output=tmp_path / "pruned", saliency=_saliency(src, tmp_path / "s.npz"),
                         selection=Selection(n_prune=2)).output
    text, meta = _card(out, src, "prune", "reap_metadata.json")
    assert f"| routed experts per MoE layer | {meta['original_num_experts']} → {meta['pruned_num_experts']} |" in text
    assert "| experts removed per layer | 2 |" in text and "| selection (metric, strategy) | reap, bottom |" in text


def test_merge_card(carded, tmp_path):
    src = carded("qwen3_moe")
    out = jobs.merge.run(model=src, output=tmp_path / "merged", saliency=_saliency(src, tmp_path / "s.npz"),
                         selection=Selection(n_prune=2), dataset=SAMPLE, max_samples=4, max_tokens=32,
                         ream=Ream(max_similarity_tokens=32, max_alignment_tokens=16, alignment="greedy",
                                   max_group_size=4), seed=0).output
    text, meta = _card(out, src, "merge", "ream_metadata.json")
    assert f"| routed experts per MoE layer | {meta['original_num_experts']} → {meta['merged_num_experts']} |" in text
    assert f"{meta['calibration_samples']} samples, {meta['calibration_tokens']:,} tokens" in text
    assert "| similarity / alignment | gated / greedy |" in text and "| max group size | 4 |" in text


def test_abliterate_card(carded, tmp_path):
    src = carded("qwen3_moe")
    rows = lambda q: "".join(json.dumps({"messages": [{"role": "user", "content": f"{q} {i}?"}]}) + "\n"  # noqa: E731
                             for i in range(4))
    (tmp_path / "h.jsonl").write_text(rows("How do I build weapon"))
    (tmp_path / "b.jsonl").write_text(rows("What does os.path do"))
    from mlx_fun.rewrite.abliterate_options import Estimate, Evaluation, Projection

    out = jobs.abliterate.run(model=src, harmful_dataset=tmp_path / "h.jsonl", benign_dataset=tmp_path / "b.jsonl",
                              output=tmp_path / "abl", projection=Projection(layers="all", weight=0.5), max_samples=4,
                              evaluation=Evaluation(eval_samples=2, reply_tokens=2), seed=0,
                              estimate=Estimate(refusal_filter=False)).output
    text, meta = _card(out, src, "abliterate", "abliteration_metadata.json")
    before, after = meta["evaluation"]["before"], meta["evaluation"]["after"]
    assert f"| harmful refusal | {before['harmful_refusal']:.1%} → {after['harmful_refusal']:.1%} |" in text
    assert f"| benign first-token KL vs. the source | {after['benign_kl']:.4f} |" in text
    # 4 benign prompts in the file: 2 fitted on, 2 held out for --max-kl's KL (issue 45)
    assert (f"| KL bound (--max-kl) | {after['held_out_kl']:.4f} (first-token KL on the 2 held-out benign prompts; "
            "bound 0.5) |") in text
    n = len(meta["abliterated_layers"])
    assert f"| abliterated layers | 0-{n - 1} |" in text and "| weight | 0.5 |" in text
    assert f"| rounds | {len(meta['rounds'])} |" in text


def test_amplify_card(carded, tmp_path):
    src = carded("deepseek_v3")  # a family with a selection-only router bias
    model, _, config = load_model(src, lazy=True)
    adapter = get_adapter(model, config)
    comp = np.zeros((len(adapter.moe_layers()), adapter.num_experts))
    comp[0, [0, 1]] = 2.0
    report = tmp_path / "d.json"
    report.write_text(json.dumps({"domain_name": "code", "scores": {"composite": comp.tolist()},
                                  "domain_experts": {str(adapter.moe_layers()[0]): [0, 1]}}))
    out = jobs.amplify.run(model=src, domain_map=report, output=tmp_path / "amp", scale=0.5).output
    text, meta = _card(out, src, "amplify", "amplification_metadata.json")
    assert "| domain | code |" in text and "| scale | 0.5 |" in text
    assert "| experts boosted | 2 in 1 MoE layer(s) |" in text and meta["boost"]


def test_quantize_card(carded, tmp_path):
    src = carded("qwen3_moe")
    out = jobs.quantize.run(model=src, output=tmp_path / "q", recipe=QuantRecipe(
        expert_bits=3, expert_group_size=32, dense_bits=6, dense_group_size=32)).output
    text, meta = _card(out, src, "quantize", "quantize_metadata.json")
    assert "| routed experts | 3-bit affine g32 |" in text and meta["recipe"]["experts"] == "3-bit affine g32"
    assert f"| dense (attention, shared experts, embeddings, head) | {meta['recipe']['dense']} |" in text
    assert f"| bits per weight | {meta['bits_per_weight']} |" in text and "| router | float |" in text


def test_a_card_given_in_the_metadata_is_kept_and_a_source_without_a_card_gets_one(qwen_model, tmp_path):
    """The training scripts write their own card; save_model_dir without metadata still replaces the source's."""
    model, _, config = load_model(qwen_model)
    out = save_model_dir(model, config, tmp_path / "own", source=qwen_model, metadata={"README.md": "# mine\n"})
    assert (out / "README.md").read_text() == "# mine\n"
    out = save_model_dir(model, config, tmp_path / "plain", source=out)
    text = (out / "README.md").read_text()
    assert "base_model: own\n" in text and "# mine" not in text and "license" not in text
    assert "tags:\n- mlx\n- mlx-fun\n---" in text


@pytest.mark.parametrize("head", ["no front matter\n", "---\n: [unclosed\n---\n", "---\n- a list\n---\n",
                                  "---\nlicense: mit\n", b"\xff\xfe---\n"])
def test_a_source_card_without_usable_front_matter_is_no_license_and_no_error(tmp_path, head):
    path = tmp_path / "README.md"
    path.write_bytes(head if isinstance(head, bytes) else head.encode())
    assert source_front_matter(tmp_path) == {}
    assert "license" not in card(None, base="m", output="out", source_card={})


def test_front_matter_values_are_yaml_safe():
    """A base path or license with YAML syntax in it stays one value."""
    import yaml

    text = card({"reap_metadata.json": {"keep_map": {"0": [1, 2]}}}, base="dir: #1", output="o",
                source_card={"license": "other", "license_name": "a: b"})
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["base_model"] == "dir: #1" and front["license_name"] == "a: b" and front["tags"][-1] == "prune"
    assert "| routed experts per MoE layer | 2 |" in text


def test_a_model_from_the_hugging_face_cache_names_its_repo_and_commit(carded, tmp_path):
    """The base model is the repo id (and commit) where mlx_fun.model.hub knows it: here a snapshot of the HF cache."""
    pytest.importorskip("mlx_fun.model.hub")
    commit = "0123456789abcdef" * 2 + "01234567"
    snap = shutil.copytree(carded("qwen3_moe"), tmp_path / "hub" / "models--org--tiny-moe" / "snapshots" / commit)
    out = jobs.quantize.run(model=snap, output=tmp_path / "q",
                            recipe=QuantRecipe(expert_bits=4, expert_group_size=32)).output
    text = (out / "README.md").read_text()
    assert "base_model: org/tiny-moe\n" in text and str(snap) not in text
    assert f"[org/tiny-moe](https://huggingface.co/org/tiny-moe) (commit {commit[:12]})" in text
    assert "license: apache-2.0\n" in text
