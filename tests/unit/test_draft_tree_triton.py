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


# The vocabulary pass under block geometries other than the default (``_TUNING["vocab_geom"]``,
# which the GPU benchmark's --tune times): the GPU benchmark's own top-K check against the
# PyTorch path (plain rows and a heavily tied copy with a constant row), the same ids as the
# default geometry's, the lowest ids first on a plateau, and the launches' block sizes and
# grid those of the geometry asked for (so a geometry the host ignored fails too).
GEOM_CHECK = """
import torch
from ddtree_cli import draft_tree as dt
from tests.unit.triton_interpret_check import gpu_bench  # and its fix of Triton 3.6

kern = dt._kernels()
launched = {}


class Spy:
    # Records the grid and block sizes of each launch of a kernel, then launches it.
    def __init__(self, name):
        self.name, self.kernel = name, kern[name]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            sizes = {k: kwargs[k] for k in ("CH", "CPG", "GPP") if k in kwargs}
            launched.setdefault(self.name, []).append((tuple(grid), sizes))
            return self.kernel[grid](*args, **kwargs)

        return launch


for name in ("vocab_stats", "vocab_select"):
    kern[name] = Spy(name)

cpu = torch.device("cpu")
gen = torch.Generator().manual_seed(11)
plateau = torch.full((1, 2, 3000), -3.0)
spots = torch.randperm(3000, generator=gen)[:40]  # 40 equal maxima spread over the blocks
plateau[:, :, spots] = 2.0
CASES = [
    # (name, logits, k): Zipf-shaped rows (the benchmark's), a vocabulary no block divides
    ("zipf", gpu_bench.draft_logits((2, 3, 3001), "zipf", gen, cpu), 16),
    ("zipf", gpu_bench.draft_logits((1, 2, 20000), "zipf", gen, cpu), 64),
    ("randn", (torch.randn(1, 2, 40000, generator=gen) * 2).to(torch.bfloat16), 8),
    ("plateau", plateau.to(torch.bfloat16), 16),
]
DEFAULT = dt._TUNING["vocab_geom"]
# The default first; the last, tiny (many groups per row), only on the small vocabularies
# (the interpreter runs each program in Python).
GEOMS = [DEFAULT, (16, 32, 8), (64, 8, 4), (32, 8, 16), (8, 2, 2)]
want = {}
for geom in GEOMS:
    dt._TUNING["vocab_geom"] = geom
    ch, cpg, gpp = geom
    for i, (name, x, k) in enumerate(CASES):
        if ch * cpg * gpp < 256 and x.shape[-1] > 4000:
            continue
        launched.clear()
        # The benchmark's check: log-probs within 1e-5 of the PyTorch path's, the logits at
        # the ids equal, on x and on its rounded copy (heavy ties, row 0 constant).
        *_, ids = gpu_bench.check_topk(x, k)
        rows, vocab = x.shape[0] * x.shape[1], x.shape[2]
        n_groups = -(-vocab // (ch * cpg))
        n_prog = -(-n_groups // gpp)
        sizes = dict(CH=ch, CPG=cpg, GPP=gpp)
        assert launched["vocab_stats"] == [((rows, n_prog), sizes)] * 2, launched
        assert launched["vocab_select"] == [((rows,), dict(CH=ch, CPG=cpg))] * 2, launched
        if geom == DEFAULT:
            want[i] = ids
        for got, exp in zip(ids, want[i], strict=True):
            assert torch.equal(got, exp), (geom, name)
        if name == "plateau":
            assert (ids[0] == spots.sort().values[:k]).all(), (geom, ids[0])
    print(f"ok geom {geom}")
for bad in [(32, 16, 6), (1, 16, 8), (32, 16), (32.0, 16, 8), (1024, 1024, 2)]:
    dt._TUNING["vocab_geom"] = bad
    try:
        dt._triton_topk_logprobs(CASES[0][1], 16)
    except ValueError as exc:
        print(f"ok geom refused: {exc}")
    else:
        raise AssertionError(f"geometry {bad} accepted")
"""


def test_triton_topk_under_other_block_geometries_under_the_interpreter():
    proc = run_interpreted(["-c", GEOM_CHECK], 600)
    assert proc.stdout.count("ok geom (") == 5, proc.stdout
    assert proc.stdout.count("ok geom refused") == 5, proc.stdout
