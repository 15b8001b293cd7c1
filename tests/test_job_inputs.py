"""Every path a job reads is checked against its output by the one writer (issue 29, row 1).

The cases are generated from the jobs' own signatures (:func:`mlx_fun.writer.path_params`): every parameter
annotated with ``Path`` of every job that writes is placed inside (directory outputs, with ``force``) or at
(file outputs) the output, and must be refused with a one-line error naming that parameter, before anything
is loaded or written, the input intact. A new option that reads a file is covered the moment it exists: this
test fails until it has a sample file below.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
from pathlib import Path

import pytest

from mlx_fun import jobs, writer
from mlx_fun.cli import COMMANDS, module_name
from mlx_fun.errors import UserError
from mlx_fun.settings import option_groups

from .cli_helpers import expect_error, run as cli
from .test_nothing_lost import tree

#: job → (output parameter, "file" | "dir", base keyword arguments (values: sample names or literals))
WRITERS = {
    "collect": ("output", "file", [{"model": "model", "dataset": "dataset",
                                    "settings.dispatch_table": "dispatch_table"}]),
    "prune": ("output", "dir", [{"model": "model", "saliency": "saliency", "selection.n_prune": 1,
                                 "safety_map": "safety_map", "safety_mode": "protect", "domain_map": "domain_map",
                                 "domain_mode": "protect"},
                                {"model": "model", "expert_list": "expert_list"}]),
    "merge": ("output", "dir", [{"model": "model", "dataset": "dataset", "saliency": "saliency",
                                 "selection.n_prune": 1, "settings.dispatch_table": "dispatch_table"},
                                {"model": "model", "dataset": "dataset", "expert_list": "expert_list"}]),
    "eval": ("output", "file", [{"model": "model", "dataset": ["dataset"], "reference": "reference",
                                 "settings.dispatch_table": "dispatch_table"}]),
    "demo": ("output", "dir", [{"model": "model"}]),
    "serve": ("auto_save", "file", [{"model": "model", "steering.safety_map": "safety_map",
                                     "steering.steering_mode": "safe", "steering.domain_map": "domain_map",
                                     "steering.domain_steering_mode": "boost",
                                     "settings.dispatch_table": "dispatch_table", "server.data_dir": "data_dir",
                                     "draft_model": "reference"}]),
    "safety_scan": ("output", "file", [{"model": "model", "harmful_dataset": "dataset", "benign_dataset": "dataset2",
                                        "settings.dispatch_table": "dispatch_table"}]),
    "domain_scan": ("output", "file", [{"model": "model", "domain_dataset": "dataset", "general_dataset": "dataset2",
                                        "domain_name": "code", "settings.dispatch_table": "dispatch_table"}]),
    "amplify": ("output", "dir", [{"model": "model", "domain_map": "domain_map"}]),
    "abliterate": ("output", "dir", [{"model": "model", "harmful_dataset": "dataset", "benign_dataset": "dataset2",
                                      "projection.target": "safety-experts", "projection.safety_map": "safety_map",
                                      "evaluation.eval_harmful_dataset": "dataset3",
                                      "evaluation.eval_benign_dataset": "dataset4",
                                      "settings.dispatch_table": "dispatch_table"}]),
    "quantize": ("output", "dir", [{"model": "model", "saliency": "saliency", "recipe.cold_layers": 1,
                                    "recipe.cold_bits": 2}]),
    "stats_diff": ("output", "file", [{"file1": "saliency", "file2": "saliency2"}]),
    "stats_merge": ("output", "file", [{"files": ["saliency", "saliency2"]}]),
    "stats_purge": ("output", "file", [{"input": "saliency", "min_freq": 1}]),
    "tune_dispatch": ("output", "file", [{"model": "model", "measure.max_m": 1}]),
}
#: jobs that write nothing
READERS_ONLY = {"smoke_test", "steer", "ui", "doctor"}


@pytest.fixture(scope="module")
def samples(tmp_path_factory, qwen_model):
    """Valid sample files of every kind a job reads, by name."""
    from mlx_fun.dispatch_table import Table, table_text

    root = tmp_path_factory.mktemp("inputs")
    model = root / "model"
    shutil.copytree(qwen_model, model)
    shutil.copytree(qwen_model, root / "reference")
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
             "import os\nprint(os.getcwd())\n", "How do I sort a list in Python?"]
    for i, name in enumerate(("dataset", "dataset2", "dataset3", "dataset4")):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts[i:] + texts[:i]))
    jobs.collect.run(model=model, dataset=root / "dataset.jsonl", output=root / "saliency.npz", max_tokens=32)
    shutil.copy(root / "saliency.npz", root / "saliency2.npz")
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    (root / "expert_list.json").write_text(json.dumps(
        {"format": "mlx-fun-expert-list", "layers": {str(i): {"remove": [0]} for i in range(layers)}}))
    (root / "safety_map.json").write_text(json.dumps({"safety_critical": {"0": [1]}}))
    (root / "domain_map.json").write_text(json.dumps({"domain_experts": {"0": [1]}}))
    (root / "dispatch_table.json").write_text(table_text(Table()))
    (root / "data_dir").mkdir()
    files = {"model": model, "reference": root / "reference", "data_dir": root / "data_dir"}
    files.update({p.stem: p for p in root.glob("*.*")})
    return files


def _cases():
    for job, (out_param, kind, variants) in WRITERS.items():
        reads = getattr(jobs, job).run.reads
        covered = {k for v in variants for k in v if k in reads}
        yield pytest.param(job, "__coverage__", None, id=f"{job}-covers-every-input")
        for name in sorted(covered):
            yield pytest.param(job, name, next(v for v in variants if name in v), id=f"{job}-{name}")


def grouped(run, kwargs: dict) -> dict:
    """``kwargs`` with every ``group.field`` key folded into that option group (its default with the field set)."""
    groups = option_groups(run)
    out = {k: v for k, v in kwargs.items() if "." not in k}
    for key, v in kwargs.items():
        if "." in key:
            group, field = key.split(".")
            out[group] = dataclasses.replace(out.get(group, inspect.signature(run).parameters[group].default),
                                             **{field: v})
    assert set(out) - set(inspect.signature(run).parameters) == set(), out
    return out


def test_every_job_is_wrapped_and_listed():
    names = {module_name(c) for c in COMMANDS}
    assert names == set(WRITERS) | READERS_ONLY
    for name in names:
        run = getattr(jobs, name).run
        assert run.reads == tuple(writer.path_params(run.__wrapped__)), name


@pytest.mark.parametrize("job, name, variant", list(_cases()))
def test_an_input_at_or_inside_the_output_is_refused(job, name, variant, samples, tmp_path):
    out_param, kind, variants = WRITERS[job]
    run = getattr(jobs, job).run
    if name == "__coverage__":
        covered = {k for v in variants for k in v}
        missing = [r for r in run.reads if r not in covered]
        assert not missing, f"add a sample for {job}'s new input(s) {missing} to WRITERS"
        return

    def value(v):
        if isinstance(v, list):
            return [value(x) for x in v]
        return samples[v] if isinstance(v, str) and v in samples else v

    kwargs = {k: value(v) for k, v in variant.items()}
    target = kwargs[name][0] if isinstance(kwargs[name], list) else kwargs[name]
    label = name.rpartition(".")[2]  # a field of an option group (settings.dispatch_table) is named by itself
    if kind == "dir":  # the input moved into an existing output directory, replaced with force
        out = tmp_path / "out"
        out.mkdir()
        inside = out / target.name
        (shutil.copytree if target.is_dir() else shutil.copy)(target, inside)
        kwargs[name] = [inside] if isinstance(kwargs[name], list) else inside
        if "force" in inspect.signature(run).parameters:
            kwargs["force"] = True
        expected = f"contains the input {label}="
    else:  # the output is the input file itself, or lies inside the input directory
        out = target / "result.out" if target.is_dir() else target
        inside = target
        expected = f"the input {label}=" if target.is_dir() else f"is the input given to {label}="
    before = tree(inside)
    kwargs[out_param] = out
    kwargs = grouped(run, kwargs)
    if job == "serve":
        kwargs["on_ready"] = lambda server: pytest.fail("served: the auto-save file was not checked")
    with pytest.raises(UserError) as err:
        run(**kwargs)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert tree(inside) == before
    if kind == "dir":
        assert sorted(p.name for p in out.iterdir()) == [inside.name]
    assert not [p for p in (out if kind == "dir" else out.parent).iterdir() if p.name.startswith(".")]


def test_abliterate_eval_set_inside_the_output_is_refused_on_the_cli(samples, tmp_path):
    """The reported case: --eval-harmful-dataset out/harmful_test.jsonl --output out --force used to exit 0 and
    delete the evaluation set it had just read."""
    out = tmp_path / "out"
    out.mkdir()
    held = out / "harmful_test.jsonl"
    shutil.copy(samples["dataset3"], held)
    before = held.read_bytes()
    for flag in ("--eval-harmful-dataset", "--eval-benign-dataset"):
        result = cli("abliterate", "--model", samples["model"], "--harmful-dataset", samples["dataset"],
                     "--benign-dataset", samples["dataset2"], flag, held, "--output", out, "--force")
        expect_error(result, f"--output {out} contains the input {flag} {held}")
        assert held.read_bytes() == before and sorted(out.iterdir()) == [held]
