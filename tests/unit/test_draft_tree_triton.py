"""The Triton kernels of draft_tree.py, run on the CPU by Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_the_pytorch_path_under_the_interpreter():
    require(importlib.util.find_spec("triton") is not None, "triton is not installed")
    # A fresh interpreter: TRITON_INTERPRET must be set before the kernels are defined.
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "unit" / "triton_interpret_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 28, proc.stdout
