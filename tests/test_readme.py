"""The README and the guides are true: every block — shell and Python — runs as written, the README's first and
then every guide page's in the order the README's "Guides" section lists them, in ONE fresh directory on the
bundled models, as a user pastes them top to bottom; a file is written only where the text asks the user to save
it; every output the text shows is what the command printed; every command's `--help` example is one of those
commands (so it runs too); every relative link resolves."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mlx_fun.cli import main

from .test_nothing_lost import tree

ROOT = Path(__file__).resolve().parents[1]
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
GUIDE = ROOT / "docs" / "guide"
ARCHITECTURES = GUIDE / "architectures.md"
#: the front page reads in five minutes (issue 44)
FRONT_PAGE_LINES = 250

#: the one directory every example of the docs writes under (the README's tour says so), and the demo's own
RUNS, DEMO = "runs", "mlx-fun-demo"

#: commands of the shell blocks that this test does not run, and why (a prefix matches)
NOT_RUN = {
    "python3 -m venv": "the test runs in the environment it was started in",
    ". .venv/bin/activate": "the test runs in the environment it was started in",
    "pip install": "the package is installed already (the README's first command is run from `mlx-fun demo` on)",
    "python -m pytest": "the test suite itself",
    "python -m scripts.training.train_tiny_moe": "8 minutes of training; test_bundled.py runs the script with tiny "
                                                 "settings",
    "mlx.launch --hostfile": "needs two machines; test_distributed.py runs the same launch with two ranks on loopback",
}


def guide_pages() -> list[Path]:
    """The guide pages in the order the README's "Guides" section links them: the one place that order is written
    (docs/guide/README.md repeats it, checked below)."""
    section = re.search(r"^## Guides\n(.*?)^## ", README, re.S | re.M)
    assert section, "the README has no '## Guides' section followed by another section"
    out: list[Path] = []
    for link in re.findall(r"\]\((docs/guide/[\w.-]+\.md)\)", section.group(1)):
        page = ROOT / link
        if page.name != "README.md" and page not in out:
            out.append(page)
    return out


def pages() -> list[Path]:
    return [README_PATH, *guide_pages()]


@dataclass
class Block:
    page: str
    kind: str  # "bash", "python", "output", or "file:NAME"
    body: str
    start: int  # offset of the block (its marker, if any) in the page


BLOCK = re.compile(r"(<!-- file: (?P<file>[^ ]+) -->\n|(?P<skip><!-- not run: [^\n]*-->\n)|(?P<out><!-- output -->\n))?"
                   r"```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def page_blocks(page: Path) -> list[Block]:
    """A page's blocks in order: ``bash`` / ``python`` blocks (run as they are), ``file:NAME`` under
    ``<!-- file: NAME -->`` (a file the text asks to save), ``output`` under ``<!-- output -->`` (what the
    command before it prints); a block under ``<!-- not run: WHY -->`` (it needs the network) is left out."""
    out, text = [], page.read_text()
    for m in BLOCK.finditer(text):
        if m.group("skip"):
            continue
        kind = (f"file:{m.group('file')}" if m.group("file") else "output" if m.group("out") else m.group("lang"))
        if kind.startswith("file:") or kind in ("bash", "python", "output"):
            out.append(Block(str(page.relative_to(ROOT)), kind, m.group("body"), m.start()))
    return out


def blocks() -> list[Block]:
    return [b for page in pages() for b in page_blocks(page)]


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


NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"


def _shown_line_matches(shown: str, printed: list[str]) -> bool:
    """Whether a line of an output block is one of the printed lines: `…` stands for anything, whitespace runs are
    one space, and each number may differ by 2% (a float's last shown digit by half a unit more; an integer below
    1,000 not at all: layer and expert indices), since another BLAS thread count moves float sums."""
    pieces = re.split(f"(…|{NUMBER})", " ".join(shown.split()))
    pattern = "".join(".*" if p == "…" else f"({NUMBER})" if re.fullmatch(NUMBER, p) else re.escape(p)
                      for p in pieces)
    wanted = [p for p in pieces if re.fullmatch(NUMBER, p)]
    for line in printed:
        m = re.fullmatch(pattern, " ".join(line.split()))
        if m and all(_close(w, g) for w, g in zip(wanted, m.groups())):
            return True
    return False


def _close(wanted: str, got: str) -> bool:
    w, g = float(wanted.replace(",", "")), float(got.replace(",", ""))
    if "." in wanted:
        return abs(g - w) <= 0.02 * abs(w) + 0.5 * 10 ** -len(wanted.split(".")[1])
    return g == w if w < 1000 else abs(g - w) <= 0.02 * w


#: the ports the docs name (serve's 8080, the dashboard's 7860): the session runs them on free ports instead, the
#: same in every command, file and shown output, so another program (or a second run of this suite) holding them
#: cannot fail the docs
DOC_PORTS = (8080, 7860)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Session:
    """One user's session over the docs: one directory, servers in the background, what ran and printed."""
    work: Path
    env: dict
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    servers: list[Background] = field(default_factory=list)
    printed: list[str] = field(default_factory=list)  # what each Python block printed
    outputs: dict = field(default_factory=dict)  # command name -> its CompletedProcess (the last one of that name)
    last: str = ""  # stdout + stderr of the last command run
    ports: dict = field(default_factory=lambda: {p: _free_port() for p in DOC_PORTS})

    def here(self, text: str) -> str:
        """``text`` with the docs' ports replaced by this session's (``:8080``, ``--port 8080``)."""
        for doc, port in self.ports.items():
            text = re.sub(rf"(?<=[: ]){doc}\b", str(port), text)
        return text

    def stop_servers(self):
        while self.servers:
            self.servers.pop().stop()

    def block(self, block: Block):
        if block.kind.startswith("file:"):  # the text asked the user to save this file, here
            (self.work / block.kind[5:]).write_text(self.here(block.body))
        elif block.kind == "output":
            printed = re.split(r"[\r\n]+", self.last)
            for line in self.here(block.body).splitlines():
                assert not line.strip() or _shown_line_matches(line, printed), \
                    f"{block.page}: shown output line {line!r} is not what {self.ran[-1]!r} printed:\n{self.last[-3000:]}"
        elif block.kind == "python":  # as a user runs it: `python` in the same directory, servers stopped
            self.stop_servers()
            proc = _run(f"python <<{block.page} block>>", [sys.executable, "-"], self.work, self.env,
                        stdin=self.here(block.body))
            self.printed.append(proc.stdout)
            self.ran.append(f"python block {len(self.printed)}")
            self.last = proc.stdout + "\n" + proc.stderr
        else:
            for cmd in commands(block.body):
                self.command(cmd)

    def command(self, cmd: str):
        cmd = self.here(cmd)
        if any(cmd.startswith(prefix) for prefix in NOT_RUN):
            self.skipped.append(cmd)
            return
        if cmd.startswith("mlx-fun ") and not cmd.startswith(CLIENTS):
            self.stop_servers()
        self.ran.append(cmd)
        if cmd.startswith(BACKGROUND):
            self.servers.append(Background(cmd, self.work, self.env))
            return
        proc = _run(cmd, cmd, self.work, self.env)
        self.outputs[cmd.split()[1] if cmd.startswith("mlx-fun ") else cmd] = proc
        self.last = proc.stdout + "\n" + proc.stderr


def test_every_doc_block_runs_in_order_in_one_directory(tmp_path):
    """Shell and Python blocks alike, README then guides, in one directory that holds only what a clone holds
    (`data/` and `scripts/`, linked): an example that needs a file a later block writes, or that only works in a
    fresh directory (the Python API block once met `pruned/` from the prune example), fails here."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    for name in ("tiny-moe", "tiny-moe-chat", "safety", "calibration_sample.jsonl"):
        (work / "data" / name).symlink_to(ROOT / "data" / name)
    (work / "scripts").symlink_to(ROOT / "scripts")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    bundled_before = tree(ROOT / "data" / "tiny-moe")
    chat_before = tree(ROOT / "data" / "tiny-moe-chat")
    session = Session(work, env)
    try:
        for block in blocks():
            session.block(block)
        session.stop_servers()
    finally:
        for server in session.servers:
            server.proc.kill()
    ran = session.ran
    assert len(ran) >= 22 and len(session.skipped) == 7, (ran, session.skipped)
    assert {c.split()[1] for c in ran if c.startswith("mlx-fun ")} >= {
        "demo", "collect", "prune", "merge", "smoke-test", "eval", "stats-diff", "stats-merge", "stats-purge",
        "tune-dispatch", "doctor", "serve", "ui", "safety-scan", "domain-scan",
        "steer", "amplify", "quantize", "abliterate"}
    assert any(c.startswith("mlx.launch --backend ring -n 2 -- mlx-fun collect") for c in ran)
    runs = work / RUNS
    for name, experts in (("pruned", 40), ("pruned-wide", 40), ("pruned-list", 40), ("merged", 40),
                          ("merged-list", 40), ("pruned-online", 40), ("pruned-domain", 40), ("api-pruned", 40),
                          ("api-merged", 40), ("my-pruned", 40)):
        assert json.loads((runs / name / "config.json").read_text())["num_experts"] == experts, name
    assert json.loads((work / DEMO / "pruned" / "config.json").read_text())["num_experts"] == 36
    assert (work / DEMO / "summary.md").is_file()
    report = json.loads((runs / "eval.json").read_text())
    assert set(report["datasets"]) == {"code", "prose"}
    for name in ("amplified/amplification_metadata.json", "safety_report.json", "domain_report.json", "online.npz",
                 "traffic.npz", "code.npz", "prose.npz", "diff.json", "merged.npz", "purged.npz", "saliency.npz",
                 "pipeline.npz", "filtered_experts.json", "chat_client.py"):
        assert (runs / name).is_file(), name
    # every output the docs write lands under runs/ (the demo's under its own directory): `rm -rf runs` undoes them
    assert sorted(p.name for p in work.iterdir()) == sorted(["data", "scripts", RUNS, DEMO]), sorted(work.iterdir())
    tuned = tmp_path / "cache" / "mlx-fun"  # tune-dispatch's user table; on a busy machine, the table beside it
    assert (tuned / "dispatch_table.json").is_file() or (tuned / "dispatch_table.busy.json").is_file()
    _check_python_api(runs, session.printed)
    _check_abliterated(runs, session.outputs["abliterate"].stderr)
    assert not [p.name for p in runs.iterdir() if p.name.startswith(".")]  # no temp or lock left
    assert tree(ROOT / "data" / "tiny-moe") == bundled_before  # the bundled models are only ever read
    assert tree(ROOT / "data" / "tiny-moe-chat") == chat_before


def _run(shown: str, cmd, cwd, env, stdin: str | None = None) -> subprocess.CompletedProcess:
    """One command of the docs (a shell line, or ``python -`` fed a block): exit 0, no error, no traceback."""
    proc = subprocess.run(cmd, shell=isinstance(cmd, str), cwd=cwd, env=env, input=stdin, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"$ {shown}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Error:" not in proc.stderr and "Traceback" not in proc.stderr, f"$ {shown}\n{proc.stderr[-3000:]}"
    return proc


def _check_python_api(runs: Path, printed: list[str]) -> None:
    """What the Python API blocks print and write: the jobs (collect → prune / merge → eval → smoke-test) and the
    library pipeline (load → hooks → accumulate → select → prune → save)."""
    import mlx_lm

    from mlx_fun.observe.saliency import SaliencyAccumulator

    assert len(printed) == 2, printed
    lines = printed[0].splitlines()
    tokens = SaliencyAccumulator.load(runs / "saliency.npz").total_tokens
    assert lines[0] == f"{tokens} tokens; (4, 48)" and tokens > 500, lines
    assert float(lines[1].split()[0]) > 0 and lines[1].endswith(" nats KL to the original"), lines
    assert "".join(lines[2:]).strip(), lines  # the merged model's reply
    acc = SaliencyAccumulator.load(runs / "pipeline.npz")
    assert acc.scores("reap").shape == (4, 48) and acc.freq.sum() > 0
    pruned, _ = mlx_lm.load(str(runs / "my-pruned"))
    assert pruned.layers[0].mlp.switch_mlp.up_proj.weight.shape[0] == 40


def _check_abliterated(runs: Path, stderr: str) -> None:
    """The abliterate example (the defaults on the bundled chat model, held-out evaluation prompts) takes it from
    refusing to answering (measured: 76.6% -> 6.2% of the held-out harmful prompts, benign first-token KL 0.328,
    benign refusals 1.6% -> 1.6%): its four refusal phrasings' directions together take the KL on the 32 benign
    prompts held out of the directions over --max-kl (0.974), so round 1 removes one direction from all refused
    prompts, and says so; its KL there ends at 0.112. (Before issue 45 the bound was checked on the capture prompts
    themselves, and the 128 benign ones fitted on were another random subset: 4.7% at KL 0.286.)"""
    meta = json.loads((runs / "abliterated" / "abliteration_metadata.json").read_text())
    before, after = meta["evaluation"]["before"], meta["evaluation"]["after"]
    assert meta["evaluation"]["held_out"] and before["harmful_refusal"] >= 0.7 and after["harmful_refusal"] <= 0.10
    assert after["benign_kl"] <= 0.35 and after["benign_refusal"] <= 0.05, after
    bound = meta["evaluation"]["kl_bound"]
    assert bound["held_out"] and bound["prompts"] == 32 and bound["held_out_kl"] <= 0.5, bound
    assert meta["direction"] == "single" and meta["direction_layer"] == 3 and meta["abliterated_layers"] == [0, 1, 2, 3]
    assert len(meta["rounds"]) == 1 and meta["phrasings"] == 4, meta["rounds"]
    first = meta["rounds"][0]
    assert first["phrasings"] == {"all": first["refused_harmful"]}, first
    assert first["refused_harmful"] >= 0.9 * first["harmful_prompts"], first
    assert "one direction from all refused prompts was removed instead" in stderr
    assert meta["modified"]["embedding"] == ["model.embed_tokens"]


def test_docs_are_laid_out_for_a_reader():
    """The front page stays short; every guide page is in the README's list, in the index page's order, and starts
    by saying it continues in the tour's directory; the README's test command is the one CI runs."""
    assert len(README.splitlines()) <= FRONT_PAGE_LINES, f"README.md has {len(README.splitlines())} lines"
    tour = README.split("## A tour on the bundled model", 1)[1]
    assert f"writes under `{RUNS}/`" in tour and f"`rm -rf {RUNS}` removes" in " ".join(tour.split()), \
        "the tour no longer says where its outputs go"
    listed = guide_pages()
    assert sorted(listed) == sorted(p for p in GUIDE.glob("*.md") if p.name != "README.md"), listed
    index = re.findall(r"^\d+\. \[[^]]+\]\(([\w.-]+\.md)\)", (GUIDE / "README.md").read_text(), re.M)
    assert index == [p.name for p in listed], "docs/guide/README.md lists the pages in another order than README.md"
    for page in listed:
        first = page.read_text().split("\n\n")[1]
        assert "README's tour" in first and "../../README.md#a-tour-on-the-bundled-model" in first, page.name
    test_command = next(b.body.strip() for b in page_blocks(README_PATH) if "python -m pytest" in b.body)
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines(), test_command


def test_every_saved_file_is_asked_for_where_it_is_written():
    """A `<!-- file: NAME -->` block stands where the text asks the user to save NAME, and before any block that
    uses NAME (`prune --expert-list filtered_experts.json` and `python chat_client.py` once came first)."""
    seen: list[Block] = []
    for block in blocks():
        if block.kind.startswith("file:"):
            name = block.kind[5:]
            before = Path(ROOT / block.page).read_text()[max(0, block.start - 300):block.start]
            assert re.search(rf"[Ss]ave this[^.]* as `{re.escape(name)}`", before), (block.page, name)
            users = [b.page for b in seen if b.kind in ("bash", "python") and name in b.body]
            assert not users, f"{name} is used in {users} before {block.page} writes it"
        seen.append(block)


def _help_examples(cmd_name: str) -> list[str]:
    """The `mlx-fun …` lines under "Example(s)" in a command's --help (continuations joined)."""
    from click.testing import CliRunner

    text = CliRunner().invoke(main, [cmd_name, "--help"]).output
    section = re.search(r"Examples?[^\n]*:\n(.*?)(\n\s*\n|\nOptions:)", text, re.S)
    assert section, f"`mlx-fun {cmd_name} --help` has no example"
    return [c for c in commands(section.group(1)) if c.startswith("mlx-fun ")]


@pytest.mark.parametrize("cmd_name", sorted(main.commands))
def test_every_help_example_is_a_docs_command(cmd_name):
    doc_commands = {normalise(c) for b in blocks() if b.kind == "bash" for c in commands(b.body)}
    examples = _help_examples(cmd_name)
    assert examples, f"`mlx-fun {cmd_name} --help` shows no runnable example"
    for example in examples:
        assert normalise(example) in doc_commands, f"{example!r} is not run by the docs test"


def test_no_help_text_names_a_command_that_does_not_exist():
    from click.testing import CliRunner

    known = set(main.commands)
    for name in sorted(known):
        text = CliRunner().invoke(main, [name, "--help"]).output
        text = re.sub(r"-\n\s*", "-", text)  # click wraps lines after a hyphen: `tune-` / `dispatch`
        for other in re.findall(r"mlx-fun\s+([a-z][a-z-]+)", text):
            assert other in known, f"`mlx-fun {name} --help` mentions `mlx-fun {other}`, which does not exist"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors of a Markdown text: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = 1
        candidate = slug
        while candidate in out:
            candidate, n = f"{slug}-{n}", n + 1
        out.add(candidate)
    return out


def _prose(text: str) -> str:
    """The text without its fenced code blocks (a `# comment` there is no heading, a `](x)` no link)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_every_relative_link_resolves():
    """Every relative link and image of README.md and docs/guide/*.md names a file that exists and, with a
    `#anchor` into Markdown, a heading of that file."""
    for page in [README_PATH, *sorted(GUIDE.glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest.read_text()), f"{page.relative_to(ROOT)}: no heading #{anchor} in {path}"


def test_architecture_table_is_the_registry():
    """The architecture table (docs/guide/architectures.md) is generated from the adapter registry (supported and
    unsupported types)."""
    from mlx_fun.adapters import table

    text = ARCHITECTURES.read_text()
    assert table.replace_in(text) == text, "run: python -m mlx_fun.adapters.table --write docs/guide/architectures.md"
    assert "| `gemma4_text`, `gemma4`, `gemma4_unified` | decoder layer (`router` + `experts`) |" in text
    assert "| `longcat_flash` | — | **not supported**: the router also picks" in text
