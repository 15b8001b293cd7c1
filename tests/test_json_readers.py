"""Every JSON reader survives any bytes (issue 41, row 10): one line naming the file, exit 2, nothing written.

A document nested 100k deep stopped every reader (config.json, dispatch tables, expert lists, safety / domain
reports, JSONL dataset lines) with ``internal error RecursionError``. The cases are generated from the jobs'
own signatures, as :mod:`tests.test_job_inputs` does: every option of every command that reads a file is
classified (a JSON kind or not), and every JSON one is given each bad document below on the command line, in
process; the user dispatch table (``$MLX_FUN_DISPATCH_TABLE``) too, for every command that reads it. A new option
that reads a file fails :func:`test_every_input_is_classified` until it is listed here.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from mlx_fun.experts import expert_files
from mlx_fun.output import streaming
from mlx_fun import jobs
from mlx_fun.cli import COMMANDS, module_name
from mlx_fun.errors import UserError

from .cli_helpers import expect_error, run as cli
from .test_hub import cache_repo, hf, model_files  # noqa: F401 -- hf: the fixture of an offline Hugging Face cache
from .test_job_inputs import WRITERS, samples  # noqa: F401 -- the fixture of valid sample files

#: the bad documents: name → bytes (a valid JSON document nested 100k deep, not UTF-8, cut off, a list on top)
BAD = {
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "not-utf8": b'{"content": "caf\xe9"}\n',
    "truncated": b'{"content": "half a',
    "wrong-type": b"[1, 2, 3]",
}

#: what a job's path parameter holds (by its name, less the option group): a JSON kind, or None (not JSON)
KINDS = {"model": "config", "reference": "config", "draft_model": "config", "adapter_path": "adapter",
         "expert_list": "file",
         "safety_map": "file", "domain_map": "file", "dispatch_table": "file",
         "saliency": None, "file1": None, "file2": None, "files": None, "input": None, "data_dir": None}
#: the commands that only read, with the options they need
READERS = {
    "doctor": [{"model": "model"}],
    "smoke_test": [{"model": "model", "settings.dispatch_table": "dispatch_table", "draft_model": "reference",
                    "adapter_path": "adapter", "max_tokens": 1}],
    "steer": [{"model": "model", "adapter_path": "adapter", "prompt": "hi", "max_tokens": 1,
               "steering.safety_map": "safety_map", "mode": "safe",
               "steering.domain_map": "domain_map", "domain_mode": "boost",
               "settings.dispatch_table": "dispatch_table", "draft_model": "reference"}],
}
#: a file output's name, by job (the writer wants the suffix the job writes)
SUFFIX = {"collect": ".npz", "serve": ".npz", "stats_diff": ".json", "tune_dispatch": ".json"}


def kind(param: str) -> str | None:
    label = param.rpartition(".")[2]
    return "jsonl" if label.endswith("dataset") else KINDS.get(label)


def variants(job: str) -> list[dict]:
    return WRITERS[job][2] if job in WRITERS else READERS.get(job, [])


def _cases():
    for command in COMMANDS:
        job = module_name(command)
        for name in getattr(jobs, job).run.reads:
            if kind(name) is None:
                continue
            variant = next((v for v in variants(job) if name in v), None)
            for bad in BAD:
                yield pytest.param(job, name, variant, bad, id=f"{job}-{name.rpartition('.')[2]}-{bad}")
        if any(name.endswith("dispatch_table") for name in getattr(jobs, job).run.reads) or job == "tune_dispatch":
            for bad in BAD:  # the user table, named by the environment
                yield pytest.param(job, "$MLX_FUN_DISPATCH_TABLE", variants(job)[0], bad,
                                   id=f"{job}-user-table-{bad}")


def test_every_input_is_classified():
    for command in COMMANDS:
        job = module_name(command)
        for name in getattr(jobs, job).run.reads:
            label = name.rpartition(".")[2]
            assert label.endswith("dataset") or label in KINDS, f"say whether {job}'s {name} is JSON in KINDS"
            if kind(name) is not None:
                assert any(name in v for v in variants(job)), f"give {job} a variant with {name}"


def _bad_input(kind_: str, sample: Path, bad: bytes, root: Path) -> tuple[Path, Path, str]:
    """``(the value to pass, the bad file, what the message names)``."""
    if kind_ in ("config", "adapter"):  # a copy of the model (adapter) whose config.json (adapter_config.json) is bad
        name = "config.json" if kind_ == "config" else "adapter_config.json"
        copy = root / ("model" if kind_ == "config" else "adapter")
        shutil.copytree(sample, copy)
        (copy / name).write_bytes(bad)
        return copy, copy / name, str(copy / name)
    path = root / f"bad{sample.suffix}"
    path.write_bytes(bad if kind_ != "jsonl" else bad + b"\n")
    return path, path, f"{path} line 1" if kind_ == "jsonl" else str(path)


def _args(job: str, variant: dict, files: dict, out: Path | None) -> list:
    args = [job.replace("_", "-")]
    for key, value in variant.items():
        flag = "--" + key.rpartition(".")[2].replace("_", "-")
        for v in value if isinstance(value, list) else [value]:
            args += [flag, files.get(v, v) if isinstance(v, str) else v]
    if out is not None:
        args += ["--auto-save" if job == "serve" else "--output", out]
    return args


@pytest.mark.parametrize("job, name, variant, bad", list(_cases()))
def test_every_json_reader_refuses_bad_bytes_in_one_line(job, name, variant, bad, samples, tmp_path,  # noqa: F811
                                                          monkeypatch):
    """Every command option (and the user table) that reads JSON, given a document nested 100k deep, bytes
    that are not UTF-8, a cut-off document or a list where an object belongs: exit 2, one line naming the file
    (and the line of a JSONL dataset), the file as it was, nothing written."""
    monkeypatch.setenv("MLX_FUN_DISPATCH_TABLE", str(tmp_path / "no-user-table.json"))
    monkeypatch.setattr("mlx_fun.jobs.serve._wait", lambda *a, **k: pytest.fail("served despite a bad input"))
    files = {k: str(v) for k, v in samples.items()}
    (tmp_path / "in").mkdir()
    if name == "$MLX_FUN_DISPATCH_TABLE":
        target, bad_file, named = _bad_input("file", samples["dispatch_table"], BAD[bad], tmp_path / "in")
        monkeypatch.setenv("MLX_FUN_DISPATCH_TABLE", str(target))
    else:
        key = name.rpartition(".")[2]
        sample = variant[name][0] if isinstance(variant[name], list) else variant[name]
        target, bad_file, named = _bad_input(kind(name), samples[sample], BAD[bad], tmp_path / "in")
        variant = {**variant, name: [f"@{key}"] if isinstance(variant[name], list) else f"@{key}"}
        files[f"@{key}"] = str(target)
    before = bad_file.read_bytes()
    outs = tmp_path / "outs"
    outs.mkdir()
    writes = job in WRITERS and not (job == "tune_dispatch" and name.startswith("$"))  # writes the user table
    out = outs / ("result" + SUFFIX.get(job, ".json" if WRITERS.get(job, ("", ""))[1] == "file" else ""))
    expect_error(cli(*_args(job, variant, files, out if writes else None)), named)
    assert bad_file.read_bytes() == before
    assert list(outs.iterdir()) == []


@pytest.mark.parametrize("bad", list(BAD))
def test_a_hugging_face_snapshots_config_is_read_by_the_one_reader(bad, hf, qwen_model, tmp_path):  # noqa: F811
    """A repo id's config.json is read once to check the repo before the weights are fetched; a deep one was an
    internal RecursionError there. Now the job's own check names the snapshot's file."""
    files = {**model_files(qwen_model), "config.json": BAD[bad]}
    snapshot = cache_repo(hf, "org/bad-config", files)
    out = tmp_path / "out"
    out.mkdir()
    expect_error(cli("collect", "--model", "org/bad-config", "--dataset", samples_dataset(), "--max-samples", 1,
                     "--output", out / "s.npz"), str(snapshot / "config.json"))
    assert list(out.iterdir()) == [] and (snapshot / "config.json").read_bytes() == BAD[bad]


def samples_dataset() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "calibration_sample.jsonl"


# ------------------------------------------------------------------------------------- reader entry points
def _safetensors(path: Path, header: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def _read_config(p):
    from mlx_fun.model.io import read_config

    (p.parent / "m").mkdir()
    shutil.move(p, p.parent / "m" / "config.json")
    read_config(p.parent / "m")
    return p.parent / "m" / "config.json"


def _read_table(p):
    from mlx_fun.dispatch.table import read_table

    try:
        read_table(p)
    except ValueError as e:  # its callers add the fix
        raise UserError(str(e)) from None


def _corpus_manifest(p):
    from mlx_fun.datasets.corpus import ensure_prepared, SPLITS

    d = p.parent / "corpus"
    for split in SPLITS:
        (d / "code").mkdir(parents=True, exist_ok=True)
        (d / "code" / f"{split}.jsonl").write_text('{"content": "x"}\n')
    shutil.move(p, d / "manifest.json")
    ensure_prepared(d, sources=("code",))
    return d / "manifest.json"


ENTRY_POINTS = {
    "io.read_config": _read_config,
    "dispatch_table.read_table": _read_table,
    "expert_files.load_expert_list": lambda p: expert_files.load_expert_list(
        p.rename(p.with_suffix(".json")), 2, 4),
    "expert_files.load_report_experts(safety)": lambda p: expert_files.load_report_experts(p, "safety"),
    "expert_files.load_report_experts(domain)": lambda p: expert_files.load_report_experts(p, "domain"),
    "streaming.read_header": lambda p: streaming.read_header(
        _safetensors(p.with_suffix(".safetensors"), p.read_bytes())),
    "corpus manifest": _corpus_manifest,
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_reader_entry_point_refuses_bad_bytes_in_one_line(entry, bad, tmp_path):
    """The readers below the commands, the ones no option reaches directly included (a safetensors header, the
    corpus manifest of scripts/prepare_dataset.py): a ``UserError`` of one line naming the file."""
    path = tmp_path / "doc"
    path.write_bytes(BAD[bad])
    with pytest.raises(UserError) as err:
        ENTRY_POINTS[entry](path)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message, message
    assert "RecursionError" not in message


@pytest.mark.parametrize("bad", [b for b in BAD if b != "not-utf8"])  # typed text: no bytes to decode
def test_the_typed_steering_body_of_the_ui_is_one_line(bad):
    from mlx_fun.ui.tabs.steering import custom_body

    with pytest.raises(UserError, match="^the custom steering ") as err:
        custom_body(BAD[bad].decode())
    assert "\n" not in str(err.value)


def test_the_host_file_of_mlx_launch_that_is_no_json_counts_no_local_rank(tmp_path):
    """The BLAS set-up reads ``$MLX_HOSTFILE`` before anything else: a bad one counts no rank on this host (the
    launcher says what is wrong with it), never a RecursionError."""
    from mlx_fun.runtime.blas import local_ranks

    for bad in BAD.values():
        (tmp_path / "hosts.json").write_bytes(bad)
        assert local_ranks({"MLX_HOSTFILE": str(tmp_path / "hosts.json")}) == 0


def test_nesting_the_parser_takes_but_later_code_recurses_on_is_refused(tmp_path, qwen_model):
    """600 levels parse (below Python's recursion limit) but copying such a config recursed; refused at the
    reader, as any JSON file mlx-fun reads nesting past MAX_DEPTH, with NaN where strict JSON forbids it."""
    from mlx_fun.core.json_input import MAX_DEPTH, parse, read

    model = tmp_path / "model"
    shutil.copytree(qwen_model, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = json.loads("[" * 600 + "]" * 600)
    (model / "config.json").write_text(json.dumps(config))
    expect_error(cli("smoke-test", "--model", model, "--max-tokens", 1),
                 f"{model / 'config.json'} nests arrays / objects more than {MAX_DEPTH} levels deep")
    assert parse("[" * MAX_DEPTH + "]" * MAX_DEPTH, "x") is not None
    with pytest.raises(UserError, match=r"^list\.json holds NaN, which JSON does not allow"):
        parse('{"a": NaN}', "list.json")
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(UserError, match="is a directory, not a regular file"):
        read(tmp_path, "table")
