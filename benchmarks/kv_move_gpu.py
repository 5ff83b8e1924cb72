"""The v2 accept's KV move: SGLang's ``move_kv_cache`` against ``window_kv_move``, on one GPU.

After a verify the v2 worker moves the accepted path's KV to the front of each request's
verify window (``ddtree_commit_v2.accept_round``). Through the pool's own ``move_kv_cache``
that copies every one of the round's ``b * W`` rows (the rows past the path copy slot 0 onto
itself) with SGLang's tiled kernel; ``ddtree_commit_v2.window_kv_move`` copies only the
accepted rows whose source is not their target. This builds SGLang's real
``MHATokenToKVPool`` (its buffers and its copy configuration, ``_init_kv_copy_and_warmup``;
SGLang must be importable, e.g. the GPU bundle's snapshot on ``PYTHONPATH``), a round's moves
per batch size (each request's path a random increasing set of window slots, its length
drawn with a mean near a trained pair's acceptance), checks that both moves leave every
buffer equal, then times each (CUDA events around ``--iters`` launches, median of
``--repeats``). On the GPU machine, with a bundle installed by ``sglang_h200/run.py``
(``--state``: its folder; SGLang then comes from the bundle, as its servers' does):

    python3 benchmarks/kv_move_gpu.py --state /tmp/ddtree-h200 --json kv_move.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bundle_args  # noqa: E402
import draft_tree_gpu  # noqa: E402
import round_graphs_gpu as rgg  # noqa: E402

V2 = ROOT / "ddtree_cli/patching/series/families/v2/sglang/srt/speculative"


def load_commit():
    """The series' ddtree_commit_v2, ``sglang.srt.speculative.ddtree_tree`` being draft_tree."""
    import sglang.srt.speculative as spec

    from ddtree_cli import draft_tree

    spec.ddtree_tree = draft_tree
    sys.modules["sglang.srt.speculative.ddtree_tree"] = draft_tree
    return rgg.load_series(V2, ("ddtree_commit_v2",))[0]


def real_pool(slots: int, layers: int, heads: int, head_dim: int, dev):
    """SGLang's ``MHATokenToKVPool`` with real buffers and its own copy configuration (its
    constructor's arguments differ between releases, so the fields its move reads are set
    here and the configuration comes from its own ``_init_kv_copy_and_warmup``)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = object.__new__(MHATokenToKVPool)
    shape = (slots + 1, heads, head_dim)
    k = [torch.randn(shape, device=dev).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape, device=dev).to(torch.bfloat16) for _ in range(layers)]
    row = heads * head_dim * 2
    fields = dict(
        size=slots, page_size=1, layer_num=layers, device=str(dev), dtype=torch.bfloat16,
        head_num=heads, head_dim=head_dim, k_buffer=k, v_buffer=v, use_hnd=False,
        use_native_move_kv_cache=False, start_layer=0, end_layer=layers - 1,
        data_ptrs=torch.tensor([t.data_ptr() for t in k + v], dtype=torch.int64, device=dev),
        data_strides=torch.tensor([row] * (2 * layers), dtype=torch.int64, device=dev),
    )  # fmt: skip
    pool.__dict__.update(fields)
    pool._init_kv_copy_and_warmup()
    return pool


def round_moves(b: int, width: int, window: int, mean_len: float, gen, dev):
    """(targets, sources, commit_lens) as ``commit_round`` lays them out: request i's window
    is slots ``1 + i * window ...``; its path the root then increasing slots."""
    tgt = torch.zeros((b, width), dtype=torch.int64)
    src = torch.zeros((b, width), dtype=torch.int64)
    p = 1.0 / mean_len
    lens = []
    for i in range(b):
        n = 1
        while n < width and torch.rand((), generator=gen).item() > p:
            n += 1
        base = 1 + i * window
        rest = torch.randperm(window - 1, generator=gen)[: n - 1].add(1).sort().values.tolist()
        for r, slot in enumerate([0] + rest):
            tgt[i, r] = base + r
            src[i, r] = base + slot
        lens.append(n)
    return (tgt.reshape(-1).to(dev), src.reshape(-1).to(dev),
            torch.tensor(lens, dtype=torch.int32, device=dev))  # fmt: skip


def timed(fn, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the device microseconds per call of ``iters`` calls."""
    return statistics.median(draft_tree_gpu.block_us(fn, iters) for _ in range(repeats))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--width", type=int, default=16, help="the walk's width (draft block)")
    ap.add_argument("--window", type=int, default=16, help="verify window slots per request")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mean-len", type=float, default=6.0)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    bundle_args.add(ap)
    args = ap.parse_args()
    bundle_args.use(args)
    dev = torch.device(args.device)
    commit = load_commit()
    batches = [int(x) for x in args.batches.split(",")]
    pool = real_pool(max(batches) * args.window + 8, args.layers, args.heads, args.head_dim, dev)
    window_move = commit.window_kv_move(pool)
    if window_move is None:
        print("window_kv_move refused this pool", file=sys.stderr)
        return 1
    own = commit.pool_move(pool)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        moves = round_moves(b, args.width, args.window, args.mean_len, gen, dev)
        bufs = pool.k_buffer + pool.v_buffer
        start = [t.clone() for t in bufs]
        own(*moves)
        after_own = [t.clone() for t in bufs]
        for t, s in zip(bufs, start, strict=True):
            t.copy_(s)
        window_move(*moves)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        equal = all(torch.equal(a, t) for a, t in zip(after_own, bufs, strict=True))
        changed = sum(
            int((a != s).any(-1).any(-1).sum()) for a, s in zip(after_own, start, strict=True)
        )
        row = {
            "batch": b, "equal": equal, "rows_changed": changed,
            "accepted": int(moves[2].sum()),
        }  # fmt: skip
        if dev.type == "cuda":
            row["pool_move_us"] = timed(lambda m=moves: own(*m), args.iters, args.repeats)
            row["window_move_us"] = timed(lambda m=moves: window_move(*m), args.iters, args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": given,
                                         "device": str(dev) if dev.type != "cuda"
                                         else torch.cuda.get_device_name(), "rows": rows},
                                        indent=1))  # fmt: skip
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
