"""Every path a job reads is checked against its output by the one writer (issue 29, row 1).

The cases are generated from the jobs' own signatures (:func:`mlx_fun.jobs.common.path_params`): every parameter
annotated with ``Path`` of every job that writes is placed inside (directory outputs, with ``force``) or at
(file outputs) the output, and must be refused with a one-line error naming that parameter, before anything
is loaded or written, the input intact. A new option that reads a file is covered the moment it exists: this
test fails until it has a sample file below.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from mlx_fun import jobs
from mlx_fun.jobs import common as job_common
from mlx_fun.cli import COMMANDS, module_name
from mlx_fun.errors import UserError, cli_names

from .cli_helpers import expect_error, run as cli
from .test_nothing_lost import tree

#: job → (output parameter, "file" | "dir", base keyword arguments (values: sample names or literals))
WRITERS = {
    "collect": ("output", "file", [{"model": "model", "adapter_path": "adapter", "dataset": "dataset",
                                    "settings.dispatch_table": "dispatch_table"}]),
    "prune": ("output", "dir", [{"model": "model", "adapter_path": "adapter", "saliency": "saliency",
                                 "selection.n_prune": 1, "safety_map": "safety_map", "safety_mode": "protect",
                                 "domain_map": "domain_map", "domain_mode": "protect"},
                                {"model": "model", "expert_list": "expert_list"}]),
    "merge": ("output", "dir", [{"model": "model", "adapter_path": "adapter", "dataset": "dataset",
                                 "saliency": "saliency", "selection.n_prune": 1,
                                 "settings.dispatch_table": "dispatch_table"},
                                {"model": "model", "dataset": "dataset", "expert_list": "expert_list"}]),
    "eval": ("output", "file", [{"model": "model", "adapter_path": "adapter", "dataset": ["dataset"],
                                 "reference": "reference", "settings.dispatch_table": "dispatch_table"}]),
    "demo": ("output", "dir", [{"model": "model"}]),
    "serve": ("auto_save", "file", [{"model": "model", "adapter_path": "adapter", "steering.safety_map": "safety_map",
                                     "steering.steering_mode": "safe", "steering.domain_map": "domain_map",
                                     "steering.domain_steering_mode": "boost",
                                     "settings.dispatch_table": "dispatch_table", "server.data_dir": "data_dir",
                                     "draft_model": "reference"}]),
    "safety_scan": ("output", "file", [{"model": "model", "adapter_path": "adapter", "harmful_dataset": "dataset",
                                        "benign_dataset": "dataset2", "settings.dispatch_table": "dispatch_table"}]),
    "domain_scan": ("output", "file", [{"model": "model", "adapter_path": "adapter", "domain_dataset": "dataset",
                                        "general_dataset": "dataset2", "domain_name": "code",
                                        "settings.dispatch_table": "dispatch_table"}]),
    "amplify": ("output", "dir", [{"model": "model", "domain_map": "domain_map"}]),
    "abliterate": ("output", "dir", [{"model": "model", "adapter_path": "adapter", "harmful_dataset": "dataset",
                                      "benign_dataset": "dataset2", "projection.target": "safety-experts", "projection.safety_map": "safety_map",
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
    from mlx_fun.dispatch.table import Table, table_text

    root = tmp_path_factory.mktemp("inputs")
    model = root / "model"
    shutil.copytree(qwen_model, model)
    shutil.copytree(qwen_model, root / "reference")
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
             "import os\nprint(os.getcwd())\n", "How do I sort a list in Python?"]
    for i, name in enumerate(("dataset", "dataset2", "dataset3", "dataset4")):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts[i:] + texts[:i]))
    jobs.collect.run(model=model, dataset=root / "dataset.jsonl", output=root / "saliency.npz", max_tokens=32)
    jobs.collect.run(model=model, dataset=root / "dataset.jsonl", output=root / "saliency2.npz", max_tokens=8)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    (root / "expert_list.json").write_text(json.dumps(
        {"format": "mlx-fun-expert-list", "layers": {str(i): {"remove": [0]} for i in range(layers)}}))
    (root / "safety_map.json").write_text(json.dumps({"safety_critical": {"0": [1]}, "hcdg": {"0": [1]}}))
    (root / "domain_map.json").write_text(json.dumps({"domain_experts": {"0": [1]}}))
    (root / "dispatch_table.json").write_text(table_text(Table()))
    (root / "data_dir").mkdir()
    from mlx_fun.testing.tiny import make_tiny_adapter

    files = {"model": model, "reference": root / "reference", "data_dir": root / "data_dir",
             "adapter": make_tiny_adapter(model, root / "adapter")}
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
    out = {k: v for k, v in kwargs.items() if "." not in k}
    fields: dict[str, dict] = {}
    for key, v in kwargs.items():
        if "." in key:
            group, field = key.split(".")
            fields.setdefault(group, {})[field] = v
    for group, values in fields.items():  # all at once: a group checks the rules between its fields when built
        out[group] = dataclasses.replace(out.get(group, inspect.signature(run).parameters[group].default), **values)
    assert set(out) - set(inspect.signature(run).parameters) == set(), out
    return out


def test_every_job_is_wrapped_and_listed():
    names = {module_name(c) for c in COMMANDS}
    assert names == set(WRITERS) | READERS_ONLY
    for name in names:
        run = getattr(jobs, name).run
        assert run.reads == tuple(job_common.path_params(run.__wrapped__)), name


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


# ---------------------------------------------------------------------------------------------------------------
# Issue 41 rows 1-3: what exists at the output is replaced only with --force; what is not a regular file (a device,
# a FIFO), or is a symbolic link, never is; --force never deletes a model read through links into the output.
# The cases come from WRITERS (each command's first sample), run through the CLI in-process (serve: its job, which
# must refuse before it serves).
OUT_NAMES = {"collect": "out.npz", "stats_merge": "out.npz", "stats_purge": "out.npz", "serve": "out.npz"}
#: the demo has no --force: its output is its own work directory, refused when the demo did not create it
NO_FORCE = {"demo"}
#: what a run that must work adds to the sample: the tiny qwen model refuses no prompt (abliterate) and has no
#: router bias to amplify (the same writer path as prune's, quantize's and merge's --force replaces its directory)
WORKING = {"abliterate": {"refusal_filter": False}, "amplify": None}


def cli_args(job: str, kwargs: dict) -> list[str]:
    """``mlx-fun <job> --flag value ...`` for job keyword arguments (a group's field is named by itself)."""
    args = [job.replace("_", "-")]
    for key, value in kwargs.items():
        flag = "--" + key.rpartition(".")[2].replace("_", "-")
        if isinstance(value, bool):
            args += [flag if value else f"--no-{flag[2:]}"]
        else:
            for v in value if isinstance(value, list) else [value]:
                args += [flag, str(v)]
    return args


def attempt(job: str, samples, out: Path, *, force: bool, **override):
    """Run ``job`` on its first sample with its output at ``out``: (exit code, the Error: lines, all output)."""
    out_param, kind, variants = WRITERS[job]

    def value(v):
        if isinstance(v, list):
            return [value(x) for x in v]
        return samples[v] if isinstance(v, str) and v in samples else v

    kwargs = {**{k: value(v) for k, v in variants[0].items()}, **override, out_param: out}
    if job == "serve":
        run = getattr(jobs, job).run
        try:
            with cli_names():  # messages name flags, as under the CLI
                run(**grouped(run, kwargs), force=force,
                    on_ready=lambda server: pytest.fail("served: the auto-save file was not checked"))
        except UserError as e:
            return 2, [f"Error: {e}"], str(e)
        return 0, [], ""
    result = cli(*cli_args(job, kwargs), *(["--force"] if force else []))
    return result.exit_code, [ln for ln in result.output.splitlines() if ln.startswith("Error:")], result.output


def _writer_ids():
    return [pytest.param(job, id=job) for job in WRITERS]


@pytest.mark.parametrize("job", _writer_ids())
def test_an_existing_output_is_replaced_only_with_force(job, samples, tmp_path):
    """Row 1: without --force one line naming the output and --force, exit 2, the output's bytes unchanged, nothing
    left beside it; with --force the command works and replaces it."""
    out_param, kind, _ = WRITERS[job]
    flag = "--" + out_param.replace("_", "-")
    if kind == "dir":
        out = tmp_path / "out"
        out.mkdir()
        (out / "mine.txt").write_text("hand-made, hours of work\n")
    else:  # a table tune-dispatch merges into must be one
        out = tmp_path / OUT_NAMES.get(job, "out.json")
        out.write_text("hand-made, hours of work\n" if job != "tune_dispatch" else
                       samples["dispatch_table"].read_text())
    before = tree(out)
    code, errors, text = attempt(job, samples, out, force=False)
    assert code == 2 and len(errors) == 1, text
    needle = "non-empty directory that the demo did not create" if job in NO_FORCE else "--force"
    assert f"{flag} {out}" in errors[0] and needle in errors[0], errors[0]
    assert tree(out) == before and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    if job in NO_FORCE or job == "serve" or WORKING.get(job, {}) is None:  # serve with force serves (its
        return                                                          # auto-save: test_serve_cli)
    code, errors, text = attempt(job, samples, out, force=True, **WORKING.get(job, {}))
    assert code == 0, text
    assert tree(out) != before and not (out / "mine.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _not_regular(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a character device (root only: /dev/null's numbers) and symbolic links (to a file, dangling)."""
    made = {}
    os.mkfifo(tmp_path / "fifo")
    made["FIFO"] = tmp_path / "fifo"
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made["character device"] = tmp_path / "null"
    (tmp_path / "target.txt").write_text("the link's target\n")
    (tmp_path / "link").symlink_to("target.txt")
    made["symbolic link"] = tmp_path / "link"
    (tmp_path / "dangling").symlink_to("nowhere/new.txt")
    made["dangling symbolic link"] = tmp_path / "dangling"
    return made


def _entry(path: Path) -> tuple:
    st = path.lstat()
    return (stat.S_IFMT(st.st_mode), st.st_ino, os.readlink(path) if path.is_symlink() else None)


@pytest.mark.parametrize("job", _writer_ids())
def test_an_output_that_is_not_a_regular_file_is_refused_even_with_force(job, samples, tmp_path):
    """Row 2: a FIFO or a character device is never replaced by a file (as root, stats-purge --output /dev/null
    did), a symbolic link is neither replaced nor written through, and where a directory is written, none of them
    is one: one line, exit 2, each left as it was, nothing created."""
    out_param, kind, _ = WRITERS[job]
    made = _not_regular(tmp_path)
    before = {name: _entry(p) for name, p in made.items()}
    listing = sorted(p.name for p in tmp_path.iterdir())
    for what, out in made.items():
        code, errors, text = attempt(job, samples, out, force=job not in NO_FORCE)
        assert code == 2 and len(errors) == 1, (what, text)
        if kind == "file" or what.endswith("symbolic link"):
            expected = {"FIFO": "is a FIFO", "character device": "is a character device"}.get(what, "symbolic link")
        else:
            expected = "exists and is not a directory"
        click_refused = "Invalid value for '--output'" in errors[0]  # a click.Path(file_okay=False) option
        assert expected in errors[0] or click_refused, (what, errors[0])
    assert {name: _entry(p) for name, p in made.items()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing
    assert (tmp_path / "target.txt").read_text() == "the link's target\n"


@pytest.fixture(scope="module")
def linked_models(samples, tmp_path_factory):
    """The sample model read through links into another directory, two ways: by hand (``lm/f → ../store/f``) and as
    the Hugging Face cache lays a snapshot out (``snapshots/<rev>/f → ../../blobs/<hash>``)."""
    from .test_hub import cache_repo, model_files

    root = tmp_path_factory.mktemp("linked")
    store, lm = root / "store", root / "lm"
    shutil.copytree(samples["model"], store)
    lm.mkdir()
    for f in store.iterdir():
        (lm / f.name).symlink_to(Path("..") / "store" / f.name)
    snapshot = cache_repo(root / "hub", "org/tiny", model_files(samples["model"]))
    return {"by hand": (lm, store), "hf cache": (snapshot, snapshot.parents[1] / "blobs")}


def _model_readers():
    for job in WRITERS:
        if "model" in getattr(jobs, job).run.reads:
            for layout in ("by hand", "hf cache"):
                yield pytest.param(job, layout, id=f"{job}-{layout.replace(' ', '-')}")


@pytest.mark.parametrize("job, layout", list(_model_readers()))
def test_force_never_deletes_a_model_whose_files_link_into_the_output(job, layout, linked_models, samples):
    """Row 3: every file the model consists of counts where its link leads. The directory the links point into (a
    directory output) or a file they point at (a file output) is refused with --force, naming --model; the model,
    links and targets, is intact."""
    model, targets = linked_models[layout]
    out_param, kind, _ = WRITERS[job]
    out = targets if kind == "dir" else next(p for p in sorted(targets.iterdir()) if p.is_file())
    before = (tree(model), tree(targets), sorted(os.readlink(p) for p in model.iterdir()))
    code, errors, text = attempt(job, samples, out, force=job not in NO_FORCE, model=model)
    assert code == 2 and len(errors) == 1, text
    assert "the input --model" in errors[0] or "the input model=" in errors[0], errors[0]
    assert "is a link to" in errors[0], errors[0]
    assert (tree(model), tree(targets), sorted(os.readlink(p) for p in model.iterdir())) == before
