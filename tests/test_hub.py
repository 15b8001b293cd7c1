"""Hugging Face repo ids for --model / --reference (issue 30): resolved as mlx-lm resolves them, recorded in what is
written, refused in one line. Against a real Hugging Face cache laid out on disk as huggingface_hub lays it out
(``models--org--name/{blobs,refs,snapshots}``), offline; the Hub's own refusals come from a stand-in of its API on
loopback. No test touches the network.

huggingface_hub reads ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` / ``HF_ENDPOINT`` once, at its import: the subprocess
runs of the installed ``mlx-fun`` get them from the environment, as a user sets them; in-process runs also set
the module constants the environment would have set.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mlx_fun.model import hub
from mlx_fun import jobs

from .cli_helpers import expect_error, run

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "calibration_sample.jsonl"
MLX_FUN = shutil.which("mlx-fun") or str(Path(sys.executable).with_name("mlx-fun"))
REPO = "org/tiny-moe"
MAIN = "0123456789abcdef0123456789abcdef01234567"
TAGGED = "fedcba9876543210fedcba9876543210fedcba98"


def cache_repo(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = MAIN,
               refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay ``files`` out as huggingface_hub caches a snapshot: content-addressed blobs (an LFS file's sha256, a
    git blob id otherwise), the snapshot's relative symlinks to them, ``refs/<name>`` holding the commit."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    for name, data in files.items():
        if name.endswith(".safetensors"):
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (storage / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(storage / "blobs" / blob, snapshot))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)  # refs/pr/1 is a file in refs/refs/pr/
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def model_files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()}


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links as their targets, files as their sha256): what "nothing written" compares."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = ("-> " + os.readlink(p) if p.is_symlink() else
                    hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
    return out


@pytest.fixture
def hf(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline, the Hub's address a closed loopback port."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    for name, env, value in (("HF_HUB_CACHE", "HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "HF_HUB_OFFLINE", True),
                             ("ENDPOINT", "HF_ENDPOINT", "http://127.0.0.1:9")):
        monkeypatch.setenv(env, "1" if value is True else value)
        monkeypatch.setattr(constants, name, value)
    return cache


@pytest.fixture
def cached(hf, qwen_model):
    """``org/tiny-moe`` in the cache: ``main`` at one commit, tag ``v1`` at another (the same tiny qwen3_moe)."""
    cache_repo(hf, REPO, model_files(qwen_model), MAIN, ("main",))
    cache_repo(hf, REPO, model_files(qwen_model), TAGGED, ("v1",))
    return hf


def test_the_cache_is_laid_out_as_huggingface_hub_lays_it_out(cached):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cached)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {MAIN, TAGGED}
    assert {ref for r in repo.revisions for ref in r.refs} == {"main", "v1"}


def test_collect_prune_smoke_test_by_repo_id_through_the_installed_cli(cached, tmp_path):
    """The user's path: the environment alone (HF_HUB_CACHE, HF_HUB_OFFLINE=1) makes the id resolve from the
    cache; the pruned model's metadata says which repo and commit it came from; the cache is only read."""
    before = tree(cached)

    def mlx_fun(*args):
        proc = subprocess.run([MLX_FUN, *map(str, args)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "Error" not in proc.stderr, proc.stderr[-3000:]
        return proc

    collect = mlx_fun("collect", "--model", REPO, "--dataset", SAMPLE, "--output", "s.npz", "--max-samples", 4,
                      "--max-tokens", 64)
    assert f"--model {REPO} (main): snapshot {MAIN[:12]} in {cached}" in collect.stderr
    mlx_fun("prune", "--model", REPO, "--saliency", "s.npz", "--n-prune", 2, "--output", "pruned")
    meta = json.loads((tmp_path / "pruned" / "reap_metadata.json").read_text())
    assert meta["base_model"] == {"repo_id": REPO, "revision": "main", "commit": MAIN}
    assert json.loads((tmp_path / "pruned" / "config.json").read_text())["num_experts"] == 6
    smoke = mlx_fun("smoke-test", "--model", REPO, "--prompt", "def f(x):", "--max-tokens", 4)
    assert "tok/s" in smoke.stdout + smoke.stderr
    assert tree(cached) == before


def test_revisions_the_reference_and_the_python_api(cached, tmp_path):
    """A tag and a commit hash each resolve to their snapshot and are recorded as asked; eval's --reference takes
    an id; the job API takes ``revision=`` beside ``model=``."""
    path, origin = hub.resolve(REPO, revision="v1")
    assert path == str(cached / f"models--org--tiny-moe/snapshots/{TAGGED}")
    assert origin == {"repo_id": REPO, "revision": "v1", "commit": TAGGED}
    got = jobs.collect.run(model=REPO, revision="v1", dataset=SAMPLE, output=tmp_path / "s.npz", max_samples=4,
                           max_tokens=64)
    assert got.tokens > 0
    result = run("prune", "--model", REPO, "--revision", TAGGED, "--saliency", tmp_path / "s.npz", "--n-prune", 2,
                 "--output", tmp_path / "pruned")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "pruned" / "reap_metadata.json").read_text())
    assert meta["base_model"] == {"repo_id": REPO, "revision": TAGGED, "commit": TAGGED}
    result = run("eval", "--model", tmp_path / "pruned", "--reference", REPO, "--dataset", SAMPLE, "--max-samples", 2,
                 "--max-tokens", 32, "--output", tmp_path / "eval.json")
    assert result.exit_code == 0 and "ref ppl" in result.output, result.output
    report = json.loads((tmp_path / "eval.json").read_text())  # the repo id as given, not its snapshot directory
    assert report["reference"] == REPO and report["reference_source"] == {"repo_id": REPO, "revision": "main",
                                                                          "commit": MAIN}
    assert report["model"] == str(tmp_path / "pruned") and report["model_source"] is None
    assert hub.source(cached / f"models--org--tiny-moe/snapshots/{MAIN}") == {"repo_id": REPO, "commit": MAIN}
    assert hub.source(tmp_path / "pruned") is None


def test_a_local_directory_wins_over_a_repo_id_of_the_same_name(cached, qwen_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(qwen_model, tmp_path / REPO)
    jobs.collect.run(model=REPO, dataset=SAMPLE, output="s.npz", max_samples=4, max_tokens=64)
    result = run("prune", "--model", REPO, "--saliency", "s.npz", "--n-prune", 2, "--output", "pruned")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "pruned" / "reap_metadata.json").read_text())["base_model"] == {
        "path": str(tmp_path / REPO)}  # the local directory, not the repo
    expect_error(run("prune", "--model", REPO, "--revision", "v1", "--saliency", "s.npz", "--n-prune", 2,
                     "--output", "pruned-v1"),
                 f"--revision v1 applies to a Hugging Face repo id, but --model {REPO} is a local directory")
    assert not (tmp_path / "pruned-v1").exists()
    assert "A local directory of that name wins" in " ".join(run("collect", "--help").output.split())


def _dense(qwen_model) -> dict[str, bytes]:
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "rms_norm_eps": 1e-6, "vocab_size": 512}
    files = {k: v for k, v in model_files(qwen_model).items() if k.startswith("tokenizer")}
    return {"config.json": json.dumps(config).encode(), **files}


#: (row, what the cache holds: repo id → files of a function of the tiny model, --model, --revision, the error line)
ROWS = [
    ("not-cached offline", {}, "org/absent", None,
     ["--model org/absent is not a local directory, nor in the Hugging Face cache", "HF_HUB_OFFLINE is set"]),
    ("revision not in the cache", {REPO: model_files}, REPO, "v9",
     ["--revision v9 of --model org/tiny-moe is not in the Hugging Face cache", "cached: main, 0123456789ab"]),
    ("no config.json", {REPO: lambda m: {k: v for k, v in model_files(m).items() if k != "config.json"}}, REPO, None,
     [f"--model {REPO} (commit {MAIN[:12]}) has no config.json: it is not an mlx-lm model"]),
    ("a dense model", {REPO: _dense}, REPO, None,
     [f"--model {REPO} (commit {MAIN[:12]}) is a dense llama model", "not a Mixture-of-Experts model", "Supported architectures"]),
    ("no weights", {REPO: lambda m: {k: v for k, v in model_files(m).items() if ".safetensors" not in k}}, REPO, None,
     ["has no model*.safetensors weights"]),
    ("neither a path nor an id", {}, "./org/absent", None, ["does not exist", "or a Hugging Face repo id (org/name)"]),
]


@pytest.mark.parametrize("holds, model, revision, needles", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_what_cannot_be_resolved_is_one_line_and_nothing_is_written(hf, qwen_model, tmp_path, monkeypatch, holds,
                                                                    model, revision, needles):
    monkeypatch.chdir(tmp_path)
    for repo_id, files in holds.items():
        cache_repo(hf, repo_id, files(qwen_model))
    before = tree(tmp_path)
    args = ["--revision", revision] if revision else []
    expect_error(run("collect", "--model", model, *args, "--dataset", SAMPLE, "--output", "out.npz"), *needles)
    assert tree(tmp_path) == before  # neither the output nor anything in the cache


class _Hub(BaseHTTPRequestHandler):
    """The Hub's answers to ``GET /api/models/<org>/<name>/revision/<rev>`` for a missing, a gated repo and a
    missing revision (status and ``X-Error-Code`` as the Hub sends them); anything else 404."""

    ANSWERS = {"org/missing": (401, "RepoNotFound"), "org/gated": (403, "GatedRepo"), REPO: (404, "RevisionNotFound")}

    def do_GET(self):
        m = re.match(r"/api/models/([^/]+/[^/]+)/revision/", self.path)
        status, code = self.ANSWERS.get(m.group(1), (404, "")) if m else (404, "")
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def online(hf, monkeypatch):
    """Online mode against the stand-in Hub on loopback; yields a closed loopback port's URL too."""
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield closed
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("model, revision, needles", [
    ("org/missing", None, ["--model org/missing is neither a local directory nor a Hugging Face repo", "HF_TOKEN"]),
    ("org/gated", None, ["--model org/gated is a gated Hugging Face repo", "accept its terms", "HF_TOKEN"]),
    (REPO, "nope", ["--revision nope does not exist in the Hugging Face repo org/tiny-moe"]),
    ("unreachable", None, ["--model org/tiny-moe is not a local directory, nor in the Hugging Face cache",
                           "the Hugging Face Hub could not be reached", "check the network"]),
], ids=["no such repo", "gated", "no such revision", "no network"])
def test_the_hubs_refusals_are_one_line_and_nothing_is_written(online, hf, tmp_path, monkeypatch, model, revision,
                                                               needles):
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    if model == "unreachable":
        monkeypatch.setattr(constants, "ENDPOINT", online)
        model = REPO
    args = ["--revision", revision] if revision else []
    before = tree(tmp_path)
    expect_error(run("prune", "--model", model, *args, "--saliency", "s.npz", "--n-prune", 2, "--output", "out"),
                 *needles)
    assert tree(tmp_path) == before


def test_an_unreachable_hub_falls_back_to_the_cache_at_once(cached, tmp_path):
    """As mlx-lm does: HF_HUB_OFFLINE unset, the Hub's address a closed port, a cached repo id is used at once with
    one line saying so. It took 27 s here (five "Retrying in Ns" lines, from listing the commit's files again); the
    bound is generous, no timing test."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HUB_CACHE=str(cached), HF_ENDPOINT="http://127.0.0.1:9", MLX_FUN_NO_FAST_BLAS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mlx_fun", "quantize", "--model", REPO, "--output", "q"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 20, elapsed
    said = [line for line in proc.stderr.splitlines() if "Hugging Face" in line or "Retry" in line]
    assert len(said) == 1, said
    assert said[0].startswith(f"--model {REPO} (main): the Hugging Face Hub cannot be reached (ConnectError")
    snapshot = cached / "models--org--tiny-moe" / "snapshots" / MAIN
    assert said[0].endswith(f"using the cached snapshot {MAIN[:12]} in {snapshot}")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]["bits"] == 4


#: revisions that are no branch, tag or commit: paths into the cache (another repo's ref), empty, git-invalid names
BAD_REVISIONS = ["..", "/tmp", "", "main/", ".hidden", "v1.lock", "ma..in", "a b", "a\\b", "v1^", "x\ny"]
#: the ones that crashed in huggingface_hub's own look-up (it joins the revision to refs/ as a path)
CRASHING = ["..", "/tmp", ""]
TRAVERSAL = "../../models--org--dense/refs/main"


@pytest.fixture
def neighbour(cached):
    """A second repo in the cache whose ``main`` names the commit of ``org/tiny-moe``'s tag v1."""
    (cached / "models--org--dense" / "refs").mkdir(parents=True)
    (cached / "models--org--dense" / "refs" / "main").write_text(TAGGED)
    return cached


def _cli_args(command: str) -> list[str]:
    """``command``'s required options (all but --model) with values good enough to parse."""
    import click

    from mlx_fun.cli import main

    out = []
    for p in main.get_command(click.Context(main), command).params:
        if p.required and p.name != "model":
            out += [p.opts[0], str(SAMPLE) if "dataset" in p.name else "code" if p.name == "domain_name" else "x"]
    return out


def _revision_commands() -> list[str]:
    import click

    from mlx_fun.cli import COMMANDS, main

    return [c for c in COMMANDS if "revision" in {p.name for p in main.get_command(click.Context(main), c).params}]


@pytest.mark.parametrize("command", _revision_commands())
def test_every_command_takes_branches_tags_and_commits_only(neighbour, tmp_path, monkeypatch, command):
    """Generated from the commands that take --revision: a path or a name git refuses is one line naming
    --revision and what it may be, before the cache is looked at; nothing written, the cache intact."""
    monkeypatch.chdir(tmp_path)
    before, cache = tree(tmp_path), tree(neighbour)
    for revision in CRASHING:
        expect_error(run(command, "--model", REPO, "--revision", revision, *_cli_args(command)),
                     f"--revision {revision!r} is not a branch, tag or commit hash", "refs/pr/3")
    assert tree(tmp_path) == before and tree(neighbour) == cache


def test_a_revision_is_never_a_path_into_the_cache(neighbour, tmp_path, monkeypatch):
    """The reported case: --revision ../../models--org--dense/refs/main read another repo's ref and was recorded
    verbatim in the pruned model's metadata and card."""
    monkeypatch.chdir(tmp_path)
    jobs.collect.run(model=REPO, dataset=SAMPLE, output="s.npz", max_samples=2, max_tokens=32)
    before, cache = tree(tmp_path), tree(neighbour)
    for revision in (TRAVERSAL, *BAD_REVISIONS):
        expect_error(run("prune", "--model", REPO, "--revision", revision, "--saliency", "s.npz", "--n-prune", 2,
                         "--output", "pruned"),
                     f"--revision {revision!r} is not a branch, tag or commit hash", "no '..'")
    assert tree(tmp_path) == before and tree(neighbour) == cache


@pytest.mark.parametrize("job", [j for j in jobs.ALL if "revision" in inspect.signature(j.run).parameters],
                         ids=lambda j: j.__name__.rpartition(".")[2])
def test_every_jobs_revision_is_checked_in_the_library_api(neighbour, job):
    """The rule lives where --revision is resolved (mlx_fun.model.hub), so the Python API refuses the same."""
    from mlx_fun.errors import UserError

    for revision in CRASHING:
        with pytest.raises(UserError) as err:
            job.run(model=REPO, revision=revision)
        assert f"revision= {revision!r} is not a branch" in str(err.value) and "\n" not in str(err.value)


def test_pull_request_refs_tags_and_commits_are_revisions(cached):
    storage = cached / "models--org--tiny-moe"
    (storage / "refs" / "refs" / "pr").mkdir(parents=True)
    (storage / "refs" / "refs" / "pr" / "1").write_text(TAGGED)
    for revision in ("refs/pr/1", "v1", TAGGED):
        path, origin = hub.resolve(REPO, revision=revision)
        assert Path(path).name == TAGGED and origin == {"repo_id": REPO, "revision": revision, "commit": TAGGED}


@pytest.mark.parametrize("lost", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_snapshot_whose_blobs_are_missing_is_an_incomplete_download(cached, tmp_path, monkeypatch, lost):
    """A snapshot file links to a blob that is not there (an interrupted download, blobs deleted by hand): the
    download is incomplete, and the line says how to fetch it again, not how to edit the cache."""
    monkeypatch.chdir(tmp_path)
    link = cached / "models--org--tiny-moe" / "snapshots" / MAIN / lost
    (link.parent / os.readlink(link)).unlink()
    before, cache = tree(tmp_path), tree(cached)
    result = run("collect", "--model", REPO, "--dataset", SAMPLE, "--output", "out.npz")
    expect_error(result, f"the download of --model {REPO} (main, commit {MAIN[:12]}) in the Hugging Face cache is "
                         f"incomplete", f"({lost}: their blobs are missing)", "HF_HUB_OFFLINE unset",
                 f"`hf download {REPO} --revision main`")
    assert "copy" not in result.output
    assert tree(tmp_path) == before and tree(cached) == cache


def test_a_ref_naming_a_commit_whose_snapshot_is_missing_is_an_incomplete_download(cached, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(cached / "models--org--tiny-moe" / "snapshots" / MAIN)
    before, cache = tree(tmp_path), tree(cached)
    expect_error(run("collect", "--model", REPO, "--dataset", SAMPLE, "--output", "out.npz"),
                 f"--revision main of --model {REPO} names commit '{MAIN}' in the Hugging Face cache",
                 "(refs/main), but the cache holds no snapshot of that commit: an incomplete download",
                 f"`hf download {REPO} --revision main`")
    assert tree(tmp_path) == before and tree(cached) == cache
