"""The tested mlx-lm range and the private mlx-lm names mlx-fun uses (mlx_fun/mlx_lm_compat.py): every one of them is
in the table, every table entry exists in the installed mlx-lm, and a missing one is one line naming it, the
feature and the range (at a feature's entry, or mid-run instead of an AttributeError); doctor prints all of it."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mlx_fun import mlx_lm_compat as compat
from mlx_fun.model import moe_hook
from mlx_fun.adapters import get_adapter
from mlx_fun.errors import UserError
from mlx_fun.testing.tiny import build_model, tiny_config

from .cli_helpers import expect_error, run
from .conftest import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = re.compile(r"_[A-Za-z]\w*")
#: mlx-fun's own names that mlx-lm happens to use too (each checked to be mlx-fun's own, not mlx-lm's)
OWN = {
    "_capture": "jobs/abliterate.py: its own capture method",
    "_entries": "dispatch_table.Table: its own entry dict",
}
#: the compat module's accessors (``mlx_lm_compat.<name>(...)``, or adapters.base's ``model_function(...)``):
#: their string arguments name table entries
ACCESSORS = {"get", "lookup", "model_function", "member"}


def _accessor_call(node) -> bool:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "model_function"
    return isinstance(func, ast.Attribute) and func.attr in ACCESSORS and \
        isinstance(func.value, ast.Name) and func.value.id in ("mlx_lm_compat", "compat")


def _private_defined_by_mlx_lm() -> set[str]:
    """Single-underscore names the installed mlx-lm defines: functions, classes, module globals, and attributes
    it assigns (``self._x = ...``)."""
    names = set()
    for path in Path(mlx_lm.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(errors="replace"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if PRIVATE.fullmatch(n) and not n.startswith("__")}


def _uses():
    """``(imports, accessed, mentioned)`` over mlx_fun/**/*.py: underscore names imported from mlx-lm as
    ``(module, name)``; names passed to the compat accessors; every ``._name`` attribute and ``"_name"`` string,
    each with the files that use it."""
    imports, accessed, mentioned = {}, {}, {}
    for path in sorted((ROOT / "mlx_fun").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
                for alias in node.names:
                    if alias.name.startswith("_"):
                        imports.setdefault((node.module, alias.name), set()).add(rel)
            elif isinstance(node, ast.Call) and _accessor_call(node):
                strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if strings and rel != "mlx_fun/mlx_lm_compat.py":
                    accessed.setdefault(tuple(strings[-2:]), set()).add(rel)
            name = node.attr if isinstance(node, ast.Attribute) else node.value if (
                isinstance(node, ast.Constant) and isinstance(node.value, str)) else None
            if name and PRIVATE.fullmatch(name) and not name.startswith("__"):
                mentioned.setdefault(name, set()).add(rel)
    return imports, accessed, mentioned


def _table_names() -> set[str]:
    return {row.name.split(".")[-1] for row in compat.TABLE}


def test_every_private_mlx_lm_name_used_in_mlx_fun_is_in_the_table():
    imports, accessed, mentioned = _uses()
    rows = {(row.module, row.name) for row in compat.TABLE}
    assert not imports, f"import these through mlx_fun.mlx_lm_compat.get / lookup instead: {imports}"
    for args, files in accessed.items():  # get(feature, module, name) / lookup(module, name): the exact row
        if len(args) == 2 and args[0].startswith("mlx_lm"):
            assert args in rows, f"{'.'.join(args)} ({sorted(files)}) is not in mlx_lm_compat.TABLE"
        else:  # model_function(module, name) / member(obj, name): a model file's name
            assert args[-1] in _table_names(), f"{args[-1]} ({sorted(files)}) is not in mlx_lm_compat.TABLE"
    theirs = _private_defined_by_mlx_lm()
    unlisted = {n: sorted(f) for n, f in mentioned.items() if n in theirs and n not in _table_names() and n not in OWN}
    assert not unlisted, f"private mlx-lm names used in mlx_fun/ but not in mlx_lm_compat.TABLE: {unlisted}"


def test_every_table_entry_exists_in_the_installed_mlx_lm_and_is_used():
    assert [row.path for row in compat.TABLE if not compat.present(row)] == []
    assert len({(row.module, row.name) for row in compat.TABLE}) == len(compat.TABLE)
    _, accessed, mentioned = _uses()
    used = set(mentioned) | {args[-1] for args in accessed}
    assert [row.path for row in compat.TABLE if row.name.split(".")[-1] not in used] == [], "stale table rows"
    for row in compat.TABLE:
        for feature in row.features + row.fallback:
            assert compat.describe(feature)  # a known feature or a model type's routing
        for feature in row.features:
            compat.require(feature)


def test_own_names_are_mlx_funs():
    """The OWN coincidences are defined in mlx_fun itself (so the scan's exemption hides no mlx-lm name)."""
    source = "\n".join(p.read_text() for p in (ROOT / "mlx_fun").rglob("*.py"))
    for name in OWN:
        assert re.search(rf"def {name}\(|self\.{name}(: [^=]+)? =", source), name


def test_pyproject_pins_the_tested_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [d.split(";")[0].strip() for d in project["dependencies"]]
    assert f"mlx-lm{compat.MLX_LM_RANGE}" in deps
    assert compat.MLX_LM_RANGE == ">=0.32.2,<0.33"
    assert {d for d in deps if d.startswith("mlx[") or d.startswith("mlx>")} == {
        f"mlx{compat.MLX_RANGE}", f"mlx[cpu]{compat.MLX_RANGE}"}
    assert compat.in_tested_range(compat.installed("mlx-lm"))


@pytest.mark.parametrize("version, inside", [("0.32.2", True), ("0.32.9", True), ("0.32.1", False),
                                             ("0.33.0", False), ("0.33.0rc1", False), ("1.0", False)])
def test_tested_range(version, inside):
    assert compat.in_tested_range(version) is inside


def test_routing_rows_name_every_model_type_that_uses_them(monkeypatch):
    """Run every family's hooked forward (tiny random weights, in memory) and record which model-file names its
    routing takes: each must be a table row of that model type's routing, which ``adapter_class`` requires."""
    seen: set = set()
    for accessor, owner in (("model_function", compat.function_owner), ("member", compat.member_owner)):
        original = getattr(compat, accessor)

        def spy(obj, name, original=original, owner=owner):
            seen.add(owner(obj, name))
            return original(obj, name)

        monkeypatch.setattr(compat, accessor, spy)
    rows = {(row.module, row.name): row for row in compat.TABLE}
    for model_type in FAMILIES:
        config = tiny_config(model_type)
        adapter = get_adapter(build_model(config), config)
        seen.clear()
        with moe_hook.hooked(adapter):
            mx.eval(adapter.model(mx.array([[5, 17, 99, 3]])))
        for key in seen:
            assert key in rows, f"{model_type}: {'.'.join(key)} is not in mlx_lm_compat.TABLE"
            assert compat.routing_feature(model_type) in rows[key].features, f"{model_type}: {'.'.join(key)}"


def _line(path: str, needed_by: str) -> str:
    return (f"mlx-lm {mlx_lm.__version__} lacks {path}, needed by {needed_by}; mlx-fun is tested with mlx-lm "
            f">=0.32.2,<0.33: pip install 'mlx-lm>=0.32.2,<0.33'")


def test_a_missing_name_is_one_line_naming_it_and_the_range(monkeypatch):
    import mlx_lm.models.switch_layers as switch_layers

    monkeypatch.delattr(switch_layers, "_gather_sort")
    with pytest.raises(UserError) as e:
        compat.require("dispatch")
    assert str(e.value) == _line("mlx_lm.models.switch_layers._gather_sort",
                                 "mlx-fun's expert dispatch (--dispatch auto / mlx-fun)")
    with pytest.raises(UserError, match="lacks mlx_lm.models.switch_layers._gather_sort"):
        compat.get("dispatch", "mlx_lm.models.switch_layers", "_gather_sort")
    compat.require("smoke-test")  # other features still run


def test_a_missing_routing_name_refuses_the_model_before_loading(monkeypatch, make_model, tmp_path):
    import mlx_lm.models.deepseek_v3 as deepseek_v3

    model = make_model("deepseek_v3")
    monkeypatch.delattr(deepseek_v3, "group_expert_select")
    out = tmp_path / "s.npz"
    result = run("collect", "--model", model, "--dataset", ROOT / "data" / "calibration_sample.jsonl",
                 "--output", out, "--max-samples", 2)
    expect_error(result, _line("mlx_lm.models.deepseek_v3.group_expert_select", "the deepseek_v3 adapter's routing"))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_model_classes_chooses_the_model_file_as_get_classes_does(monkeypatch):
    """compat.model_module against mlx-lm's own _get_classes, for every model file, every alias of its
    MODEL_REMAPPING and every (type, architecture) of its MODEL_ARCHITECTURE_REMAPPING (no model file imported:
    _get_classes' import_module answers the name it was given); the tables read from mlx_lm/utils.py equal the
    imported ones."""
    import types

    import mlx_lm.utils

    assert compat._read_remapping() == (mlx_lm.utils.MODEL_REMAPPING, mlx_lm.utils.MODEL_ARCHITECTURE_REMAPPING)
    monkeypatch.setattr(mlx_lm.utils, "importlib", types.SimpleNamespace(
        import_module=lambda name: types.SimpleNamespace(Model=name, ModelArgs=name)))
    files = [p.stem for p in (Path(mlx_lm.__file__).parent / "models").glob("*.py") if not p.stem.startswith("_")]
    configs = [{"model_type": t} for t in [*files, *mlx_lm.utils.MODEL_REMAPPING]]
    configs += [{"model_type": t, "architectures": [a]} for t, a in mlx_lm.utils.MODEL_ARCHITECTURE_REMAPPING]
    configs += [{"model_type": t, "architectures": a} for t, a in mlx_lm.utils.MODEL_ARCHITECTURE_REMAPPING]
    assert len(configs) > 100
    for config in configs:
        assert compat.model_module(config) == mlx_lm.utils._get_classes(config)[0], config


def test_the_model_check_needs_no_private_get_classes(monkeypatch, qwen_model, tmp_path):
    """smoke-test's model check and the config check find mlx-lm's classes by its tables and model files, where
    _get_classes is gone; it only confirms a type that has no model file (mlx-lm's ValueError: not supported)."""
    import json
    import shutil

    import mlx_lm.models.deepseek_v3 as deepseek_v3
    import mlx_lm.utils

    from mlx_fun.jobs.smoke_test import check_generatable

    unknown = shutil.copytree(qwen_model, tmp_path / "m")
    (unknown / "config.json").write_text(json.dumps({**json.loads((unknown / "config.json").read_text()),
                                                     "model_type": "no_such_type"}))
    with pytest.raises(UserError, match="model_type 'no_such_type' .* is not supported by the installed mlx-lm"):
        check_generatable(unknown)
    monkeypatch.delattr(mlx_lm.utils, "_get_classes")
    assert check_generatable(qwen_model)["model_type"] == "qwen3_moe"
    assert compat.model_classes({"model_type": "kimi_k2"}) == (deepseek_v3.Model, deepseek_v3.ModelArgs)
    with pytest.raises(ValueError, match="no_such_type not supported"):
        compat.model_classes({"model_type": "no_such_type"})


@pytest.mark.parametrize("model_type, module, name, path", [
    ("phimoe", "mlx_lm.models.phimoe", "sparsemixer", "mlx_lm.models.phimoe.sparsemixer"),
    ("laguna", "mlx_lm.models.laguna", "MoEGate._routing_scores", "mlx_lm.models.laguna.MoEGate._routing_scores"),
])
def test_a_name_gone_mid_run_is_the_one_line_not_an_attribute_error(monkeypatch, model_type, module, name, path):
    import importlib

    config = tiny_config(model_type)
    adapter = get_adapter(build_model(config), config)
    owner, _, attr = name.rpartition(".")
    target = importlib.import_module(module)
    monkeypatch.delattr(getattr(target, owner) if owner else target, attr)
    with pytest.raises(UserError) as e, moe_hook.hooked(adapter):
        adapter.model(mx.array([[5, 17, 99, 3]]))
    assert str(e.value) == _line(path, f"the {model_type} adapter's routing")


def test_doctor_prints_versions_range_and_compat():
    result = run("doctor")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"mlx: {compat.installed('mlx')} (mlx-fun needs >=0.32.2)" in lines
    assert f"mlx-lm: {mlx_lm.__version__} (tested range >=0.32.2,<0.33)" in lines
    assert f"mlx-lm compat: OK: all {len(compat.TABLE)} private mlx-lm names mlx-fun uses are present" in lines


def test_doctor_names_a_missing_name_and_exits_1(monkeypatch):
    import mlx_lm.models.switch_layers as switch_layers

    monkeypatch.delattr(switch_layers, "_scatter_unsort")
    result = run("doctor")
    assert result.exit_code == 1, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("mlx-lm compat:"))
    assert line == (f"mlx-lm compat: MISSING 1 of {len(compat.TABLE)}: mlx_lm.models.switch_layers._scatter_unsort "
                    "(dispatch); mlx-fun is tested with mlx-lm >=0.32.2,<0.33: pip install 'mlx-lm>=0.32.2,<0.33'")
