"""The Triton kernels of draft_tree.py, run on the CPU by Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """``python ARGS`` in a fresh interpreter under Triton's CPU interpreter (TRITON_INTERPRET
    must be set before the kernels are defined); fails the test if it fails."""
    require(importlib.util.find_spec("triton") is not None, "triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_triton_kernels_match_the_pytorch_path_under_the_interpreter():
    proc = run_interpreted([str(ROOT / "tests" / "unit" / "triton_interpret_check.py")], 600)
    assert proc.stdout.count("ok ") == 28, proc.stdout


# The verify-input kernel writing into a caller's buffer (``mask_out``, what a CUDA graph of
# the verify inputs shares across batch sizes): the real entries equal the PyTorch path's,
# the buffer's tail is kept unless ``mask_numel`` asks for it to be cleared.
MASK_OUT_CHECK = """
import torch
from ddtree_cli import draft_tree as dt
import tests.unit.triton_interpret_check  # its fix of Triton 3.6's interpreter

gen = torch.Generator().manual_seed(7)
tree = dt.build_tree(torch.randn(3, 15, 40, generator=gen) * 3, 15, use_triton=False)
roots, prefix = torch.tensor([5, 6, 7]), torch.tensor([9, 0, 4])
exact = dt.verify_inputs(tree, roots, prefix, use_triton=False)
numel = exact.tree_mask.numel()
buffer = torch.ones(numel + 100, dtype=torch.bool)
got = dt.verify_inputs(tree, roots, prefix, mask_out=buffer, use_triton=True)
assert got.tree_mask is buffer
assert torch.equal(buffer[:numel], exact.tree_mask) and buffer[numel:].all()
for name in ("input_ids", "positions", "mask_indptr"):
    assert torch.equal(getattr(got, name), getattr(exact, name)), name
buffer.fill_(True)
dt.verify_inputs(tree, roots, prefix, mask_out=buffer, mask_numel=numel + 60, use_triton=True)
assert torch.equal(buffer[:numel], exact.tree_mask)
assert not buffer[numel : numel + 60].any() and buffer[numel + 60 :].all()
print("ok mask_out")
"""


def test_triton_verify_inputs_into_a_buffer_under_the_interpreter():
    proc = run_interpreted(["-c", MASK_OUT_CHECK], 300)
    assert proc.stdout.count("ok mask_out") == 1, proc.stdout
