"""Whether the first replay of a DDTREE round graph costs more than the later ones.

On the H200 (docs/performance.md, "Round graphs") both servers with round graphs had single
rounds of 240-350 ms in their forward window, once per batch bucket and width, which the
eager server did not have. This captures the round graphs as the workers do
(``ddtree_round_graphs.warm_rounds`` then ``capture_round_graphs``, loaded from the patch
series as ``round_graphs_gpu.py`` loads them) and times each graph's first three replays:
host time of ``replay()`` and device time (CUDA events), ms.

Usage: python benchmarks/first_replay_gpu.py [--sizes 1,2,4,8,16,32] [--budgets 15,64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_graphs_gpu import add_head_args, patch_head  # noqa: E402


def timed(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return round(host, 3), round(start.elapsed_time(end), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    ap.add_argument("--budgets", default="15,64")
    add_head_args(ap)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, rg, head = patch_head(args)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    budgets = [int(x) for x in args.budgets.split(",") if x]
    rg.warm_rounds(head, None, None, sizes=sizes, budgets=budgets, n_pos=args.positions, device=dev)
    rows = []
    for capture in (1, 2):  # a second set of graphs in the same process
        graphs = rg.capture_round_graphs(
            head, None, sizes=sizes, pairs=[(b, b) for b in budgets], n_pos=args.positions,
            device=dev,
        )  # fmt: skip
        if graphs is None:
            print("round graphs not captured", file=sys.stderr)
            return 1
        with torch.no_grad():
            for (size, _k, budget), (static, replay, _) in graphs._graphs.items():
                static.normal_()
                row = {"capture": capture, "size": size, "budget": budget}
                for i in (1, 2, 3):
                    row[f"replay{i}_host_ms"], row[f"replay{i}_gpu_ms"] = timed(replay)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
