"""What a DDTREE round adds between the draft pass and the verify pass, eager and replayed.

The patched worker runs, after the draft's graph replay and before the target's, the draft
head (the target's LM head over the 15 drafted positions, then the top-K log-probs) and the
tree build; DFLASH runs the LM head and an argmax. This times, on one GPU and without
SGLang, the patch's own code for that section (``ddtree_utils.draft_topk_logprobs``,
``ddtree_tree.build_tree_from_topk`` and ``ddtree_round_graphs``' start-up warm-up and capture
as both workers call them, ``warm_rounds`` and ``capture_round_graphs``, loaded
from the patch series; ``ddtree_tree`` is ``ddtree_cli.draft_tree``, which the series
vendors verbatim) at a Qwen3-8B-shaped head (hidden 4096, vocabulary 151936, bf16):

- ``dflash``: LM head + argmax per position (the baseline, eager as in SGLang);
- ``ddtree eager``: LM head + top-K log-probs + tree build, launched from Python;
- ``ddtree graph``: the same replayed by ``DraftRoundGraphs`` (copy in + one replay).

Per arm and (batch, budget): ``host_us``, the Python time to issue the section while the GPU
is still busy with earlier work (what the host spends before it can launch the verify), and
``gpu_us``, the device time of the section alone (CUDA events around it, issued behind a
sleep kernel so that no launch gap is counted). A round costs at least the larger of the two;
the arms differ in the host part. Before timing, the replayed tree is checked against the
eager one (same tokens, parents and node count), at batch sizes that a graph of a larger size
serves too. Hidden states are random (shallow trees; the build's device time grows with the
tree's depth, see draft_tree_gpu.py --logits).

Usage: python benchmarks/round_graphs_gpu.py [--batches 1,3,8,32] [--budgets 15,64] [--json F]
"""

# The timed closures run within their own loop iteration.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ddtree_cli import draft_tree as dt  # noqa: E402

SERIES = ROOT / "ddtree_cli/patching/series/families/common/sglang/srt/speculative"


def load_series(folder: Path, stems) -> list:
    """Modules of the patch series from ``folder`` as ``sglang.srt.speculative.<stem>``, in
    order (a later one may import an earlier one)."""
    out = []
    for stem in stems:
        spec = importlib.util.spec_from_file_location(
            f"sglang.srt.speculative.{stem}", folder / f"{stem}.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        out.append(module)
    return out


def load_patch_modules():
    """The series' ddtree_utils and ddtree_round_graphs, with ``sglang.srt.speculative``
    holding ``ddtree_tree`` (= ddtree_cli.draft_tree) so their imports resolve."""
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["sglang.srt.speculative"].ddtree_tree = dt
    sys.modules["sglang.srt.speculative.ddtree_tree"] = dt
    return load_series(SERIES, ("ddtree_utils", "ddtree_round_graphs"))


def lm_head(vocab: int, hidden: int, dev) -> types.SimpleNamespace:
    """A one-rank vocab-parallel head as the worker sees it (weight + shard_indices)."""
    weight = (torch.randn((vocab, hidden), device=dev) * hidden**-0.5).to(torch.bfloat16)
    shard = types.SimpleNamespace(
        num_org_elements=vocab,
        num_org_elements_padded=vocab,
        num_added_elements=0,
        org_vocab_start_index=0,
        added_vocab_start_index=vocab,
    )
    return types.SimpleNamespace(weight=weight, shard_indices=shard)


def add_head_args(ap: argparse.ArgumentParser) -> None:
    """The head's shape: drafted positions, hidden size, vocabulary (Qwen3-8B's)."""
    ap.add_argument("--positions", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)


def patch_head(args):
    """(CUDA device, the series' ddtree_round_graphs, a head of ``args``' shape)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    _, rg = load_patch_modules()
    return dev, rg, lm_head(args.vocab, args.hidden, dev)


def host_and_gpu_us(fn, iters: int) -> tuple[float, float]:
    """Medians of (host time to issue ``fn``, device time of ``fn``), µs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(iters):
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU work ahead of the section
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(host), statistics.median(gpu)


def check_replay(graphs, eager_round, hidden, k: int, budget: int) -> None:
    _, _, want = eager_round(hidden, k, budget)
    _, _, got = graphs(hidden, k, budget)
    n = int(want.num_nodes.max())
    for field in ("num_nodes", "tokens", "parents", "depths"):
        a, b = getattr(want, field), getattr(got, field)
        if field != "num_nodes":
            a, b = a[:, :n], b[:, :n]
        if a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"replayed tree differs from eager in {field}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,3,8,32")
    ap.add_argument("--budgets", default="15,64")
    ap.add_argument("--capture-sizes", default="1,2,4,8,16,32")
    add_head_args(ap)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, rg, head = patch_head(args)
    budgets = [int(x) for x in args.budgets.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    sizes = [int(x) for x in args.capture_sizes.split(",") if x]
    # The workers' start-up code (they capture first and warm up last; here the warm-up runs
    # first, so that the capture's time leaves out the kernels' compiling).
    started = time.perf_counter()
    warmed = rg.warm_rounds(
        head, None, None, sizes=sizes, budgets=budgets, n_pos=args.positions, device=dev
    )
    warm_s = time.perf_counter() - started
    started = time.perf_counter()
    graphs = rg.capture_round_graphs(
        head, None, sizes=sizes, pairs=[(b, b) for b in budgets], n_pos=args.positions,
        device=dev,
    )  # fmt: skip
    capture_s = time.perf_counter() - started
    if graphs is None:
        print("round graphs not captured (see the warning above)", file=sys.stderr)
        return 1
    captured = graphs.snapshot()["graphs"]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; {len(warmed)} rounds "
          f"warmed in {warm_s:.1f} s, {captured} graphs captured in {capture_s:.1f} s",
          flush=True)  # fmt: skip
    rows = []
    with torch.no_grad():
        for b in batches:
            hidden = torch.randn((b, args.positions, args.hidden), device=dev).to(torch.bfloat16)

            def dflash(hidden=hidden):
                rows_ = hidden.reshape(-1, args.hidden)
                return torch.argmax(torch.matmul(rows_, head.weight.T), dim=-1)

            base_host, base_gpu = host_and_gpu_us(dflash, args.iters)
            for budget in budgets:
                check_replay(graphs, graphs.eager_round, hidden, budget, budget)
                eager = host_and_gpu_us(
                    lambda: graphs.eager_round(hidden, budget, budget), args.iters
                )
                replay = host_and_gpu_us(lambda: graphs(hidden, budget, budget), args.iters)
                row = {
                    "batch": b,
                    "budget": budget,
                    "graph_size": graphs.size_for(b),
                    "dflash_host_us": round(base_host, 1),
                    "dflash_gpu_us": round(base_gpu, 1),
                    "eager_host_us": round(eager[0], 1),
                    "eager_gpu_us": round(eager[1], 1),
                    "graph_host_us": round(replay[0], 1),
                    "graph_gpu_us": round(replay[1], 1),
                    "checked": True,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'batch':>5} {'budget':>6} | {'DFLASH host/gpu':>16} | {'eager host/gpu':>16} "
          f"| {'graph host/gpu':>16} (µs)")  # fmt: skip
    for r in rows:
        print(
            f"{r['batch']:>5} {r['budget']:>6} | {r['dflash_host_us']:>7} {r['dflash_gpu_us']:>8}"
            f" | {r['eager_host_us']:>7} {r['eager_gpu_us']:>8}"
            f" | {r['graph_host_us']:>7} {r['graph_gpu_us']:>8}"
        )
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "positions": args.positions,
            "rounds_warmed": len(warmed),
            "warm_s": round(warm_s, 2),
            "graphs_captured": captured,
            "capture_s": round(capture_s, 2),
            "snapshot": graphs.snapshot(),
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
