"""Load a script of benchmarks/sglang_h200 (not a package) as a module, for its tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parents[1] / "benchmarks" / "sglang_h200"


def load_script(name: str) -> ModuleType:
    """A fresh module of benchmarks/sglang_h200/NAME.py (e.g. "prepare", "run", "units")."""
    spec = importlib.util.spec_from_file_location(f"sglang_h200_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
