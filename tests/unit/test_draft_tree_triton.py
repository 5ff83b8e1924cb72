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


# The tree kernel's switches that are off by default (`tree_tile`, `tree_rank`; `pdl` only
# changes how kernels are launched on a GPU and is off under the interpreter): the same
# checks as the default run, on the cases that reach their code (rows shaped like a
# language model's, ties at the floor, a budget that is not a power of two, one position,
# budget 1, a vocabulary below the budget, every tree-kernel branch).
SWITCHES_CHECK = """
from ddtree_cli import draft_tree as dt
import tests.unit.triton_interpret_check as tic

switches = dict(tree_tile=1, tree_rank=1)
dt._TUNING.update(switches)
tic.DEFAULTS.update(switches)  # what the checks restore after changing the floor rules
tic.check_zipf(4, 15, 1500, 64, 200)
tic.check_zipf(2, 15, 1500, 64, 201, ties=True, modes=tic.MODES[1:3], floors=(1,))
tic.check_zipf(2, 15, 1500, 48, 200, modes=tic.MODES[1:3], floors=(1,))
for i in (5, 6, 7, 8, 9):
    case = tic.CASES[i]
    tic.check(*case[:5], i, *case[5:])
for j, case in enumerate(tic.TREE_CASES):
    tic.check_tree(*case[:5], 100 + j, *case[5:], floors=(1,))
print("ok switches", switches)
"""


def test_triton_tree_switches_match_the_pytorch_path_under_the_interpreter():
    proc = run_interpreted(["-c", SWITCHES_CHECK], 900)
    assert proc.stdout.count("ok switches") == 1, proc.stdout


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
