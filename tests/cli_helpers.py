"""Running the click group in-process and checking the one-line error contract, shared by the CLI tests."""

from __future__ import annotations

from click.testing import CliRunner

from mlx_fun.cli import main


def run(*args):
    """Invoke ``mlx-fun ARGS…`` in-process; exceptions other than SystemExit propagate to the test."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def expect_error(result, *needles):
    """Exit code 2 and exactly one ``Error:`` line that contains every needle."""
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
