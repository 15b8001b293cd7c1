"""Issue 44 part 2: mlx-lm's flags where users type them. A user copies an ``mlx_lm.generate`` / ``mlx_lm.server``
command line and changes the program name: every flag of mlx-lm's own argument parsers exists on ``smoke-test`` /
``serve`` with mlx-lm's default (but a short, commented list of deliberate differences), the same greedy command
line gives the same text as ``python -m mlx_lm generate``, and no ``--help`` names an option its command lacks."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import click
import pytest

from mlx_fun.cli import COMMANDS, main

from .cli_helpers import ROOT

#: mlx-lm flags that mlx-fun's command deliberately lacks, and why
MISSING = {
    "smoke-test": {
        "--image": "image inputs: the families mlx-fun supports are text models (no vision processor to feed)",
        "--prompt-cache-file": "a prefix KV cache saved by mlx_lm.cache_prompt, a workflow mlx-fun has no part in "
                               "(smoke-test measures the prompt it is given); mlx_lm.generate reads such files",
        "--quantize-activations": "nvfp4 / mxfp8 activation quantization (mlx-lm's QQLinear), which mlx-fun's "
                                  "dense and expert dispatch do not run",
        "-qa": "--quantize-activations' short name",
    },
    "serve": {
        "--pipeline": "mlx-lm's distributed serving (layers or tensors split over mlx.launch ranks); serve counts "
                      "and steers experts in one process (collect --pipeline splits a model over ranks)",
    },
}
#: shared flags whose default differs from mlx-lm's, and why
DEFAULTS = {
    ("serve", "allowed_origins"): "mlx-lm lets every origin call ('*'); serve's REST routes steer and save, so "
                                  "browsers may call only from origins the user lists",
    ("serve", "log_level"): "mlx-lm logs INFO (a line per request); the command line logs WARNING unless asked",
    ("serve", "max_tokens"): "None until the model's context is read: then mlx-lm's 512, or --max-tokens-limit when "
                             "that is lower (--help says so)",
}


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser ``mlx_lm.server.main`` built."""


def generate_parser() -> argparse.ArgumentParser:
    from mlx_lm.generate import setup_arg_parser

    return setup_arg_parser()


def server_parser() -> argparse.ArgumentParser:
    """``mlx_lm.server``'s parser, which ``main()`` builds and parses at once before serving: ``parse_args`` is
    replaced for the call by one that hands the parser back, so nothing loads or listens."""
    import mlx_lm.server

    def grab(self, args=None, namespace=None):
        raise _Parsed(self)

    real = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab
    try:
        mlx_lm.server.main()
    except _Parsed as e:
        return e.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError("mlx_lm.server.main() returned without parsing its command line")


PARSERS = {"smoke-test": generate_parser, "serve": server_parser}


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _ours(command: str) -> dict[str, click.Option]:
    """Every option string of ``command`` (``--prompt``, ``-p``) → its click option."""
    return {flag: p for p in main.commands[command].params if isinstance(p, click.Option) for flag in p.opts}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_mlx_lm_flag_exists_unless_listed(command):
    ours = _ours(command)
    lacking = [flag for action in _flags(PARSERS[command]()) for flag in action.option_strings
               if flag not in ours and flag not in MISSING[command]]
    assert not lacking, f"{command} lacks mlx-lm's {lacking}: add them (mlx-lm's meaning) or list them in MISSING"
    stale = [flag for flag in MISSING[command] if flag in ours]
    assert not stale, f"{command} has {stale} now: drop them from MISSING"


def _empty(value) -> bool:
    return value is None or value in ("", (), [], {})


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_shared_flags_have_mlx_lm_s_defaults(command):
    """Parsed with no flags, each shared option holds mlx-lm's parsed default (None and an empty default are the
    same: nothing given), of the same type, but those in DEFAULTS."""
    parser = PARSERS[command]()
    theirs = vars(argparse.ArgumentParser.parse_known_args(parser, [])[0])
    ctx = main.commands[command].make_context(command, ["--model", "m"])
    ours = {p.name: ctx.params[p.name] for p in main.commands[command].params if p.name in ctx.params}
    checked, wrong = 0, []
    for action in _flags(parser):
        name = action.dest
        if name == "model" or name not in ours or (command, name) in DEFAULTS:
            continue
        mine, want = ours[name], theirs[name]
        checked += 1
        if _empty(mine) and _empty(want):
            continue
        if isinstance(mine, tuple):
            mine = list(mine)
        if mine != want or type(mine) is not type(want):
            wrong.append(f"--{name.replace('_', '-')}: {mine!r} (mlx-lm: {want!r})")
    assert not wrong, f"{command}: defaults other than mlx-lm's: {wrong}"
    assert checked >= (20 if command == "smoke-test" else 18)
    for (cmd, name) in DEFAULTS:
        assert cmd != command or name in ours, f"{name}: listed in DEFAULTS but not an option of {command}"


def test_short_names_are_mlx_lm_s():
    ours = _ours("smoke-test")
    assert ours["-p"] is ours["--prompt"] and ours["-m"] is ours["--max-tokens"]


def _options(command: str) -> set[str]:
    params = main.commands[command].params
    return {o for p in params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts} | {"--help"}


def _unknown_flags(command: str, text: str) -> list[str]:
    """The ``--flags`` of ``text`` that are neither ``command``'s nor of a command a line names (``prune --saliency``,
    ``mlx-fun steer ...``)."""
    bad = []
    for line in text.splitlines():
        allowed = set().union(_options(command), *(_options(c) for c in COMMANDS if re.search(rf"\b{c}\b", line)))
        bad += [flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line) if flag not in allowed]
    return sorted(set(bad))


@pytest.mark.parametrize("command", COMMANDS)
def test_option_help_names_only_options_that_exist(command):
    """Every ``--flag`` an option's help names is one of its command's options (or of a command it names): the
    help of serve's --draft-model named a --temp that serve did not have."""
    text = "\n".join(p.help or "" for p in main.commands[command].params if isinstance(p, click.Option))
    assert not _unknown_flags(command, text), f"{command}: an option's help names {_unknown_flags(command, text)}"


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_help_of_smoke_test_and_serve_names_only_their_options(command):
    cmd = main.commands[command]
    text = cmd.get_help(click.Context(cmd, info_name=command, terminal_width=2000, max_content_width=2000))
    assert not _unknown_flags(command, text), f"{command} --help names {_unknown_flags(command, text)}"


# ------------------------------------------------------------------------------------------ the same text
CHAT_MODEL = ROOT / "data" / "tiny-moe-chat"


def _spawn(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def test_smoke_test_prints_mlx_lm_generate_s_text_for_the_same_flags():
    """Greedy, on the bundled chat model: the same command line (the chat template by default, a system prompt, an
    extra EOS token, mlx-lm's short names) gives `python -m mlx_lm generate`'s text, character for character. The
    raw prompt (--ignore-chat-template) is compared in process by test_smoke_test."""
    flags = ["--model", str(CHAT_MODEL), "-p", "How do I sort a list in Python?", "--system-prompt",
             "You are a helpful assistant.", "-m", "32", "--extra-eos-token", "<|endoftext|>", "--verbose", "False"]
    ours, theirs = _spawn("mlx_fun", "smoke-test", *flags), _spawn("mlx_lm", "generate", *flags)
    out, err = ours.communicate(timeout=300)
    want, their_err = theirs.communicate(timeout=300)
    assert ours.returncode == 0, err
    assert theirs.returncode == 0, their_err
    assert len(want.split()) > 5 and out == want, (out, want)
