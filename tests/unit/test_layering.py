"""Logic packages never import the CLI/UI libraries; draft_tree.py imports torch only."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "ddtree_cli"
UI_ONLY = {"typer", "rich", "click"}
UI_ALLOWED = {"cli.py", "console.py", "__main__.py"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_logic_modules_do_not_import_ui_libraries():
    offenders = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "commands" or rel.name in UI_ALLOWED:
            continue
        bad = _imports(path) & UI_ONLY
        if bad:
            offenders.append(f"{rel}: {sorted(bad)}")
    assert offenders == []


def test_draft_tree_imports_torch_and_stdlib_only():
    path = PKG / "draft_tree.py"
    allowed = {
        "torch",
        "triton",
        "__future__",
        "math",
        "dataclasses",
        "typing",
        "functools",
        "os",
        "collections",
    }
    assert _imports(path) - allowed == set()


def test_budget_policy_imports_the_standard_library_only():
    # A serving worker calls it unchanged: no torch, no engine, no project imports.
    path = PKG / "budget_policy.py"
    allowed = {"__future__", "logging", "threading", "collections", "dataclasses"}
    assert _imports(path) - allowed == set()
