"""Declared = imported: the code each stage declares in dvc.yaml (and so, through the parity test,
in the Snakefile) is exactly the dsflow code the stage runs, and the data files that code reads
(the builtin grammar), so editing either reruns every stage that uses it and no other."""

from __future__ import annotations

import ast
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from dsflow.cli import STAGES

PACKAGE = ROOT / "workflow"
CODE = "workflow/dsflow"
TOP = PACKAGE / "dsflow" / "__init__.py"


def module_file(name: str) -> Path | None:
    """The file of dsflow module `name` (a package's __init__.py), None if there is none."""
    base = PACKAGE.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path) -> set[str]:
    """dsflow modules a file imports, lazily or not, or starts by name (torchrun's `-m`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dsflow")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsflow"):
            found.add(node.module)
            # `from dsflow.pkg import module` names a module, not an attribute
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("dsflow.") and node.value.replace(".", "").isidentifier():
                found.add(node.value)
    return {m for m in found if module_file(m) is not None}


def data_files(path: Path) -> set[Path]:
    """Files beside a module that it names in a string ("grammar.txt"): data it reads."""
    names = {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    beside = {path.parent / n for n in names if re.fullmatch(r"[\w-]+\.\w+", n)}
    return {f for f in beside if f.suffix != ".py" and f.is_file()}


def closure(module: str) -> set[str]:
    """Files (relative to the repository) of `module` and everything it imports, transitively,
    with the data files they read. Empty __init__.py files hold no code, and dsflow's own only
    its version: both are left out."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # parent packages
        todo += sorted(imported_modules(module_file(name)))
    files = {module_file(m) for m in seen} - {TOP}
    files |= {f for m in seen for f in data_files(module_file(m))}
    return {str(f.relative_to(ROOT)) for f in files if f.read_text().strip()}


def declared_code(deps: list[str]) -> set[str]:
    """The dsflow files a stage's deps name: files as they are, folders as their .py files."""
    out = set()
    for dep in deps:
        if not dep.startswith(CODE):
            continue
        path = ROOT / dep
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        out |= {str(f.relative_to(ROOT)) for f in files if f != TOP and f.read_text().strip()}
    return out


def test_every_stage_declares_exactly_the_code_it_imports():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    problems = []
    for name, stage in stages.items():
        imported = closure(STAGES[name])
        declared = declared_code(stage.get("deps", []))
        for path in sorted(imported - declared):
            problems.append(f"{name}: imports {path} but does not declare it")
        for path in sorted(declared - imported):
            problems.append(f"{name}: declares {path} but does not import it")
    assert problems == []


def test_the_closure_follows_lazy_imports_and_launched_modules(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from dsflow.model import loss\n    return loss\n")
    assert imported_modules(lazy) == {"dsflow.model", "dsflow.model.loss"}
    train = closure(STAGES["train"])
    # The train stage starts its ranks as `-m dsflow.train.loop`, which imports the model code.
    assert f"{CODE}/train/loop.py" in train
    assert f"{CODE}/model/balance.py" in train
    assert f"{CODE}/model/loss.py" in closure(STAGES["evaluate"])
    # export imports the balancer inside a function (it loads torch).
    assert f"{CODE}/model/balance.py" in closure(STAGES["export"])
    # download imports the grammar, which reads its rules from a file beside it.
    assert f"{CODE}/data/grammar.txt" in closure(STAGES["download"])
    assert f"{CODE}/report.py" not in train


def test_the_data_files_in_the_package_ship_with_it():
    # A non-editable install copies a package's .py files only, and the data files that
    # pyproject.toml lists.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = [
        f
        for f in (PACKAGE / "dsflow").rglob("*")
        if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts
    ]
    assert f"{CODE}/data/grammar.txt" in {str(f.relative_to(ROOT)) for f in data}
    for f in data:
        package = ".".join(f.parent.relative_to(PACKAGE).parts)
        patterns = listed["package-data"].get(package, [])
        assert any(fnmatch(f.name, p) for p in patterns), f"{f} is not in package-data"


def test_no_stage_module_imports_another_stage_module():
    stage_files = {str(module_file(m).relative_to(ROOT)): s for s, m in STAGES.items()}
    problems = []
    for stage, module in STAGES.items():
        for path in imported_modules(module_file(module)):
            other = stage_files.get(str(module_file(path).relative_to(ROOT)))
            if other is not None and other != stage:
                problems.append(f"{stage} imports the {other} stage ({path})")
    assert problems == []
