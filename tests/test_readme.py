"""The README is true: every block — shell and Python — runs as written, in README order, in one fresh directory
on the bundled model (as a user follows it top to bottom), and every command's `--help` example is one of those
commands (so it runs too)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_fun.cli import main

from .test_nothing_lost import tree

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: commands of the README's shell blocks that this test does not run, and why (a prefix matches)
NOT_RUN = {
    "pip install": "the package is installed already (the README's first command is run from `mlx-fun demo` on)",
    "python -m pytest": "the test suite itself",
    "python -m scripts.training.train_tiny_moe": "8 minutes of training; test_bundled.py runs the script with tiny "
                                                 "settings",
    "mlx.launch --hostfile": "needs two machines; test_distributed.py runs the same launch with two ranks on loopback",
}


def blocks() -> list[tuple[str, str]]:
    """``("bash", text)`` for every ```bash block, ``("python", text)`` for every ```python block (run as it is)
    and ``("file:NAME", text)`` for a block under ``<!-- file: NAME -->`` (a file the README asks to save), in
    README order; a block under ``<!-- not run: WHY -->`` (it needs the network) is left out."""
    out = []
    for m in re.finditer(r"(<!-- file: (?P<file>[^ ]+) -->\n|(?P<skip><!-- not run: [^\n]*-->\n))?"
                         r"```(?P<lang>\w*)\n(?P<body>.*?)```", README, re.S):
        if m.group("skip"):
            continue
        if m.group("file"):
            out.append((f"file:{m.group('file')}", m.group("body")))
        elif m.group("lang") in ("bash", "python"):
            out.append((m.group("lang"), m.group("body")))
    return out


def commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, `&&` chains split, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line:
            out += [part.strip() for part in line.split(" && ")]
    return out


#: commands that keep running (servers): started in the background, ready once their stderr says "Serving", and
#: stopped with Ctrl+C (SIGINT) before the next `mlx-fun` command or at the end, as a user in two terminals would
BACKGROUND = ("mlx-fun serve", "mlx-fun ui")
#: of those, the clients of a running server (the dashboard): they start beside it instead of stopping it
CLIENTS = ("mlx-fun ui",)


class Background:
    def __init__(self, cmd: str, cwd, env):
        import threading

        self.cmd = cmd
        self.proc = subprocess.Popen(shlex.split(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.err.append(line)
                if "Serving" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        assert ready.wait(120) and self.proc.poll() is None, f"$ {cmd}\n{''.join(self.err)}"

    def stop(self):
        import signal

        self.proc.send_signal(signal.SIGINT)
        out = self.proc.stdout.read()
        assert self.proc.wait(120) == 0, f"$ {self.cmd}\n{out}\n{''.join(self.err)}"
        assert "Error:" not in "".join(self.err) and "Traceback" not in "".join(self.err), "".join(self.err)


def normalise(cmd: str) -> str:
    return " ".join(shlex.split(cmd))


def test_every_readme_block_runs_in_order_in_one_directory(tmp_path):
    """Shell and Python blocks alike, in README order, in one directory: an example that only works in a fresh
    directory (the Python API block once met `pruned/` from the prune example) fails here."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    for name in ("tiny-moe", "tiny-moe-chat", "safety", "calibration_sample.jsonl"):
        (work / "data" / name).symlink_to(ROOT / "data" / name)
    (work / "scripts").symlink_to(ROOT / "scripts")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    bundled_before = tree(ROOT / "data" / "tiny-moe")
    chat_before = tree(ROOT / "data" / "tiny-moe-chat")
    ran, skipped, servers, printed, outputs = [], [], [], [], {}
    for kind, body in blocks():  # files the README asks to save ("save this as …") exist from the start
        if kind.startswith("file:"):
            (work / kind[5:]).write_text(body)
    try:
        for kind, body in blocks():
            if kind == "python":  # as a user runs it: `python` in the same directory, servers stopped
                while servers:
                    servers.pop().stop()
                printed.append(_run(f"python <<README block {len(printed) + 1}>>", [sys.executable, "-"], work, env,
                                    stdin=body).stdout)
                ran.append(f"python block {len(printed)}")
                continue
            if kind != "bash":
                continue
            for cmd in commands(body):
                reason = next((why for prefix, why in NOT_RUN.items() if cmd.startswith(prefix)), None)
                if reason:
                    skipped.append(cmd)
                    continue
                if cmd.startswith("mlx-fun ") and not cmd.startswith(CLIENTS):
                    while servers:
                        servers.pop().stop()
                if cmd.startswith(BACKGROUND):
                    servers.append(Background(cmd, work, env))
                    ran.append(cmd)
                    continue
                outputs[cmd.split()[1] if cmd.startswith("mlx-fun ") else cmd] = _run(cmd, cmd, work, env)
                ran.append(cmd)
        while servers:
            servers.pop().stop()
    finally:
        for server in servers:
            server.proc.kill()
    assert len(ran) >= 22 and len(skipped) == 5, (ran, skipped)
    assert {c.split()[1] for c in ran if c.startswith("mlx-fun ")} >= {
        "demo", "collect", "prune", "merge", "smoke-test", "eval", "stats-diff", "stats-merge", "stats-purge",
        "tune-dispatch", "doctor", "serve", "ui", "safety-scan", "domain-scan",
        "steer", "amplify", "quantize"}
    assert any(c.startswith("mlx.launch --backend ring -n 2 -- mlx-fun collect") for c in ran)
    for name, experts in (("pruned", 40), ("pruned-wide", 40), ("pruned-list", 40), ("merged", 40),
                          ("merged-list", 40), ("mlx-fun-demo/pruned", 36), ("pruned-online", 40),
                          ("pruned-domain", 40), ("api-pruned", 40), ("api-merged", 40), ("my-pruned", 40)):
        assert json.loads((work / name / "config.json").read_text())["num_experts"] == experts, name
    report = json.loads((work / "eval.json").read_text())
    assert set(report["datasets"]) == {"code", "prose"}
    for name in ("amplified/amplification_metadata.json", "safety_report.json", "domain_report.json", "online.npz", "traffic.npz", "code.npz", "prose.npz", "diff.json", "merged.npz", "purged.npz", "mlx-fun-demo/summary.md",
                 "saliency.npz", "pipeline.npz"):
        assert (work / name).is_file() or (tmp_path / name).is_file(), name
    tuned = tmp_path / "cache" / "mlx-fun"  # tune-dispatch's user table; on a busy machine, the table beside it
    assert (tuned / "dispatch_table.json").is_file() or (tuned / "dispatch_table.busy.json").is_file()
    _check_python_api(work, printed)
    _check_abliterated(work, outputs["abliterate"].stderr)
    assert not [p.name for p in work.iterdir() if p.name.startswith(".")]  # no temp or lock left
    assert tree(ROOT / "data" / "tiny-moe") == bundled_before  # the bundled models are only ever read
    assert tree(ROOT / "data" / "tiny-moe-chat") == chat_before


def _run(shown: str, cmd, cwd, env, stdin: str | None = None) -> subprocess.CompletedProcess:
    """One README command (a shell line, or ``python -`` fed a block): exit 0, no error, no traceback."""
    proc = subprocess.run(cmd, shell=isinstance(cmd, str), cwd=cwd, env=env, input=stdin, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"$ {shown}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Error:" not in proc.stderr and "Traceback" not in proc.stderr, f"$ {shown}\n{proc.stderr[-3000:]}"
    return proc


def _check_python_api(work: Path, printed: list[str]) -> None:
    """What the Python API blocks print and write: the jobs (collect → prune / merge → eval → smoke-test) and the
    library pipeline (load → hooks → accumulate → select → prune → save)."""
    import mlx_lm

    from mlx_fun.observe.saliency import SaliencyAccumulator

    assert len(printed) == 2, printed
    lines = printed[0].splitlines()
    tokens = SaliencyAccumulator.load(work / "saliency.npz").total_tokens
    assert lines[0] == f"{tokens} tokens; (4, 48)" and tokens > 500, lines
    assert float(lines[1].split()[0]) > 0 and lines[1].endswith(" nats KL to the original"), lines
    assert "".join(lines[2:]).strip(), lines  # the merged model's reply
    acc = SaliencyAccumulator.load(work / "pipeline.npz")
    assert acc.scores("reap").shape == (4, 48) and acc.freq.sum() > 0
    pruned, _ = mlx_lm.load(str(work / "my-pruned"))
    assert pruned.layers[0].mlp.switch_mlp.up_proj.weight.shape[0] == 40


def _check_abliterated(work: Path, stderr: str) -> None:
    """The abliterate example (the defaults on the bundled chat model, held-out evaluation prompts) takes it from
    refusing to answering (measured: 76.6% -> 4.7% of the held-out harmful prompts, benign first-token KL 0.286,
    benign refusals 1.6% -> 0%): its four refusal phrasings' directions together take the capture benign KL over
    --max-kl, so round 1 removes one direction from all refused prompts, and says so."""
    meta = json.loads((work / "abliterated" / "abliteration_metadata.json").read_text())
    before, after = meta["evaluation"]["before"], meta["evaluation"]["after"]
    assert meta["evaluation"]["held_out"] and before["harmful_refusal"] >= 0.7 and after["harmful_refusal"] <= 0.10
    assert after["benign_kl"] <= 0.3 and after["benign_refusal"] <= 0.05, after
    assert meta["direction"] == "single" and meta["direction_layer"] == 3 and meta["abliterated_layers"] == [0, 1, 2, 3]
    assert len(meta["rounds"]) == 1 and meta["phrasings"] == 4, meta["rounds"]
    first = meta["rounds"][0]
    assert first["phrasings"] == {"all": first["refused_harmful"]}, first
    assert first["refused_harmful"] >= 0.9 * first["harmful_prompts"], first
    assert "one direction from all refused prompts was removed instead" in stderr
    assert meta["modified"]["embedding"] == ["model.embed_tokens"]


def _help_examples(cmd_name: str) -> list[str]:
    """The `mlx-fun …` lines under "Example(s)" in a command's --help (continuations joined)."""
    from click.testing import CliRunner

    text = CliRunner().invoke(main, [cmd_name, "--help"]).output
    section = re.search(r"Examples?[^\n]*:\n(.*?)(\n\s*\n|\nOptions:)", text, re.S)
    assert section, f"`mlx-fun {cmd_name} --help` has no example"
    return [c for c in commands(section.group(1)) if c.startswith("mlx-fun ")]


@pytest.mark.parametrize("cmd_name", sorted(main.commands))
def test_every_help_example_is_a_readme_command(cmd_name):
    readme_commands = {normalise(c) for kind, body in blocks() if kind == "bash" for c in commands(body)}
    examples = _help_examples(cmd_name)
    assert examples, f"`mlx-fun {cmd_name} --help` shows no runnable example"
    for example in examples:
        assert normalise(example) in readme_commands, f"{example!r} is not run by the README test"


def test_no_help_text_names_a_command_that_does_not_exist():
    from click.testing import CliRunner

    known = set(main.commands)
    for name in sorted(known):
        text = CliRunner().invoke(main, [name, "--help"]).output
        text = re.sub(r"-\n\s*", "-", text)  # click wraps lines after a hyphen: `tune-` / `dispatch`
        for other in re.findall(r"mlx-fun\s+([a-z][a-z-]+)", text):
            assert other in known, f"`mlx-fun {name} --help` mentions `mlx-fun {other}`, which does not exist"


def test_architecture_table_is_the_registry():
    """The README's architecture table is generated from the adapter registry (supported and unsupported types)."""
    from mlx_fun.adapters import table

    assert table.replace_in(README) == README, "run: python -m mlx_fun.adapters.table --write README.md"
    assert "| `gemma4_text`, `gemma4`, `gemma4_unified` | decoder layer (`router` + `experts`) |" in README
    assert "| `longcat_flash` | — | **not supported**: the router also picks" in README
