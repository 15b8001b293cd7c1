"""The package's layers, bottom-up (:data:`LAYERS`): a module imports only its own layer and those below it, lazy
imports inside functions counted (laziness keeps start-up fast; it may only point down). And no import cycles among
mlx_fun's modules: the module-level imports (those that run when a module is imported,
including inside a top-level ``if`` / ``try``, but not under ``if TYPE_CHECKING:``) form a graph without cycles,
and so do all imports, those inside functions counted (lazy imports keep start-up fast but may not hide a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_fun"

#: mlx_fun's layers, bottom-up: a folder (or one of the few top-level modules) may import its own layer and the
#: layers before it, never one after it. ``mlx_fun`` itself (``__version__``) is below all of them.
LAYERS = (
    "errors", "mlx_lm_compat",  # one-line UserErrors; the private mlx-lm names in use
    "core",  # the writer, paths, sizes, JSON input, value ranges, class swaps
    "runtime",  # lean imports, BLAS, threads
    "datasets",  # calibration samples, corpora
    "adapters",  # per-family routing, written once
    "dispatch",  # the experts' grouped matmul, per call
    "experts",  # selections, expert lists, steering reports
    "model",  # load, hub, the hooked MoE call, the forward engine, generation options
    "output",  # an mlx-lm model directory: streamed weights, model card
    "observe",  # saliency, collection, statistics, evaluation, directions
    "rewrite",  # prune, merge, abliterate, amplify, quantize
    "settings",  # how a job runs its model (RunSettings)
    "serve", "ui",  # the server and its dashboard
    "testing",  # tiny models, the load test (tests, benchmarks and the demo build on them)
    "jobs", "cli", "launcher", "__main__",
)
TOP_LEVEL_LIMIT = 8


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _top_level_imports(body: list[ast.stmt]):
    """Import statements that run at import time: the module body and its top-level if / try / with blocks."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _is_type_checking(node):
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _top_level_imports(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level_imports(handler.body)


def _targets(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The mlx_fun modules ``node`` imports (``from . import x`` imports module ``x`` if there is one; importing
    ``a.b`` runs package ``a`` first)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([node.module] if node.module else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    out = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in out if m in known and m != module}


def import_graph(root: Path = PACKAGE, *, lazy: bool = False) -> dict[str, set[str]]:
    """Module → the mlx_fun modules it imports when imported (``lazy``: anywhere, inside functions too)."""
    mods = _modules(root)
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))) if lazy else \
            _top_level_imports(tree.body)
        edges = set()
        for node in nodes:
            edges |= _targets(node, name, path.name == "__init__.py", known)
        graph[name] = edges
    return graph


def _is_parent(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[m0, m1, ..., m0]``, or None. A package importing its own submodule
    (``mlx_fun.jobs`` → ``mlx_fun.jobs.collect``, which runs the package first) is not a cycle: Python runs the
    package's body up to that import, then the submodule."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if _is_parent(nxt, node):
                continue  # a submodule "importing" its package: the package is already running
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and graph["mlx_fun.dispatch.experts"] >= {"mlx_fun.dispatch.table"}  # the graph is real
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among mlx_fun modules: " + " → ".join(cycle)


def test_no_import_cycles_counting_the_imports_inside_functions():
    """Issue 42: laziness may keep start-up fast, never hide a circle (the 11-file one through writer → settings
    → jobs.common and the corpus pair were closed by imports inside functions)."""
    cycle = find_cycle(import_graph(lazy=True))
    assert cycle is None, "import cycle among mlx_fun modules (lazy imports counted): " + " → ".join(cycle)


def test_the_named_tangles_stay_untied():
    """The cycles and upward imports of issue 31, at any level (lazy imports too)."""
    def every_import(module: str) -> set[str]:
        path = _modules()[module]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        known = set(_modules())
        return set().union(*(_targets(n, module, path.name == "__init__.py", known) for n in ast.walk(tree)
                             if isinstance(n, (ast.Import, ast.ImportFrom))))

    assert "mlx_fun.dispatch.experts" not in every_import("mlx_fun.output.streaming")
    assert "mlx_fun.serve.handler" not in every_import("mlx_fun.serve.routes")
    assert "mlx_fun.serve.handler" not in every_import("mlx_fun.serve.params")
    assert not {m for m in every_import("mlx_fun.ui.analysis") if m.startswith("mlx_fun.jobs")}
    assert "mlx_fun.model.io" not in every_import("mlx_fun.dispatch.table")
    # issue 42's: the 11-file circle (writer → settings → jobs.common → ... → dispatch_table → writer), the
    # corpus pair, and the lower layers that reached up into jobs / cli for a helper or a range
    assert "mlx_fun.settings" not in every_import("mlx_fun.core.writer")
    assert "mlx_fun.datasets.corpus" not in every_import("mlx_fun.datasets.corpus_machine")
    upward = {name: sorted(m for m in every_import(name) if m.split(".")[:2] in (["mlx_fun", "jobs"], ["mlx_fun", "cli"]))
              for name in _modules() if name.split(".")[:2] not in (["mlx_fun", "jobs"], ["mlx_fun", "cli"])
              and name not in ("mlx_fun.__main__", "mlx_fun.launcher")}  # (the console entry runs the CLI)
    assert {k: v for k, v in upward.items() if v} == {}


@pytest.mark.parametrize("source, cycle", [
    ({"a.py": "from . import b\n", "b.py": "from .a import x\n"}, True),
    ({"a.py": "def f():\n    from . import b\n", "b.py": "from .a import x\n"}, False),
    ({"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
      "b.py": "from . import a\n"}, False),
    ({"a.py": "try:\n    from .b import y\nexcept ImportError:\n    y = None\n", "b.py": "import pkg.a\n"}, True),
    ({"__init__.py": "from . import a\n", "a.py": "from . import b\n", "b.py": "x = 1\n"}, False),
])
def test_the_check_finds_cycles(tmp_path, source, cycle):
    """The checker itself: a module-level cycle is found (in a try block too); a lazy or TYPE_CHECKING import,
    or a package importing its submodules, is none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in source.items():
        (pkg / name).write_text(text)
    assert (find_cycle(import_graph(pkg)) is not None) == cycle


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 else None  # the package itself: below every layer


def test_every_module_is_in_a_layer_and_the_top_level_stays_small():
    """Issue 42: the flat modules live in folders named after their layer; at most eight files sit directly in
    mlx_fun/ (errors, mlx_lm_compat, settings and the entry points)."""
    mods = _modules()
    assert {m for m in mods if m != "mlx_fun" and m.split(".")[1] not in LAYERS} == set()
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top
    assert set(LAYERS) >= {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}


def test_no_module_imports_a_layer_above_its_own():
    """Issue 42: counting every import, those inside functions too: a lower layer never reaches up (for a helper,
    a range, a default), so each folder can be read knowing only the folders before it."""
    graph = import_graph(lazy=True)
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if _layer(b) is not None and _layer(a) is not None and _layer(b) > _layer(a))
    assert upward == []
    # the check is real: cli imports jobs, jobs import rewrite, and the order says which way is down
    assert "mlx_fun.jobs" in graph["mlx_fun.cli.collect"] | {m.rsplit(".", 1)[0] for m in graph["mlx_fun.cli.collect"]}
    assert _layer("mlx_fun.core.writer") < _layer("mlx_fun.model.engine") < _layer("mlx_fun.jobs.collect")
