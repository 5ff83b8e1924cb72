"""The verify's attention: SGLang's Triton extend kernel on a chain against a DDTREE tree mask.

DFLASH verifies its block as a causal chain (no custom mask); DDTREE verifies a tree through
a FULL_MASK custom mask (``draft_tree.verify_inputs``: per request ``n`` rows over the
prefix and the tree). SGLang's triton backend runs both through ``extend_attention_fwd``
with the same grid and block sizes; the mask only adds loads in the extend stage (the prefix
stage skips it). A profile at concurrency 32 showed this kernel 32 % slower in DDTREE's
steps, whose prefixes were also longer (DDTREE commits more a round). This separates the
two: the same batch, prefixes and width, timed as

- ``chain``: causal, no mask (DFLASH's verify);
- ``chain_mask``: the same chain written as a FULL_MASK custom mask (what the mask costs);
- ``tree``: a real DDTREE tree's mask (``draft_tree``, Zipf-like draft rows) of the same width;

both masks built by ``draft_tree.verify_inputs``, as a DDTREE round builds them.

Each variant's output is checked against PyTorch attention with the same visibility first
(``max_err``). Times: CUDA events around ``--iters`` replays of a CUDA graph holding one
launch (``NAME_us``: the kernel's device time, as in a server, whose verify forward is
replayed from SGLang's graphs) and around ``--iters`` launches from Python (``NAME_eager_us``:
bounded below by the launch's host time, about 90 µs a call on an H100, so at small batches
and prefixes it times the host, not the mask), the variants in turns, median of
``--repeats``. The first run (2026-12-06) timed eager launches only. On the GPU machine,
with a bundle installed by ``sglang_h200/run.py`` (``--state``; SGLang then comes from the bundle, as its servers' does):

    python3 benchmarks/verify_attention_gpu.py --state /tmp/ddtree-h200 --json attn.json
"""

# The launch closure runs within its own loop iteration.
# ruff: noqa: B023

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

from ddtree_cli import draft_tree as dt  # noqa: E402


def extend_kernel():
    """SGLang's ``extend_attention_fwd`` from where the release keeps it."""
    try:  # 0.5.16 on
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except ImportError:
        from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
    return extend_attention_fwd


def tree(b: int, n: int, sharpness: float | None, gen, dev) -> dt.DraftTree:
    """Real DDTREE trees of ``n - 1`` nodes over ``n - 1`` positions, built from Zipf-like
    draft rows (``draft_tree_gpu.zipf_logits``): of varying sharpness (None), or so sharp
    that every tree is the rank-0 chain."""
    import draft_tree_gpu

    lo, hi = (1.0, 6.0) if sharpness is None else (sharpness, sharpness)
    logits = draft_tree_gpu.zipf_logits((b, n - 1, 4096), gen, dev, lo, hi)
    return dt.build_tree(logits, n - 1)


def reference(q, k_buf, v_buf, b, n, prefix, vis, scale) -> torch.Tensor:
    """PyTorch attention of every request's ``n`` queries over its prefix and its tree."""
    heads, kv_heads = q.shape[1], k_buf.shape[1]
    out = torch.empty_like(q)
    for i in range(b):
        slots = torch.arange(i * (prefix + n), (i + 1) * (prefix + n), device=q.device) + 1
        k = k_buf[slots].float().repeat_interleave(heads // kv_heads, 1)  # [P+n, H, D]
        v = v_buf[slots].float().repeat_interleave(heads // kv_heads, 1)
        qi = q[i * n : (i + 1) * n].float()  # [n, H, D]
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        see = torch.cat([torch.ones((n, prefix), dtype=torch.bool, device=q.device), vis[i]], -1)
        s = s.masked_fill(~see, float("-inf"))
        out[i * n : (i + 1) * n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefixes", default="128,512,2048")
    ap.add_argument("--width", type=int, default=16, help="verify tokens per request")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    bundle_args.add(ap)
    args = ap.parse_args()
    bundle_args.use(args)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    fwd = extend_kernel()
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, hd, scale = args.width, args.head_dim, args.head_dim**-0.5
    # bf16 as served; float32 on the CPU (Triton's interpreter has no bf16 dot).
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows, ok = [], True
    for b in (int(x) for x in args.batches.split(",")):
        for prefix in (int(x) for x in args.prefixes.split(",")):
            slots = b * (prefix + n) + 1
            k_buf = torch.randn((slots, args.kv_heads, hd), device=dev, dtype=dtype)
            v_buf = torch.randn((slots, args.kv_heads, hd), device=dev, dtype=dtype)
            q = torch.randn((b * n, args.heads, hd), device=dev, dtype=dtype)
            # Request i's prefix slots, then its n verify slots (their K/V also in k_ext).
            base = torch.arange(b, device=dev) * (prefix + n) + 1
            kv_indices = (base[:, None] + torch.arange(prefix, device=dev)).reshape(-1)
            ext = (base[:, None] + prefix + torch.arange(n, device=dev)).reshape(-1)
            k_ext, v_ext = k_buf[ext].contiguous(), v_buf[ext].contiguous()
            qo_indptr = torch.arange(b + 1, device=dev, dtype=torch.int32) * n
            kv_indptr = torch.arange(b + 1, device=dev, dtype=torch.int32) * prefix
            chain = torch.ones((n, n), dtype=torch.bool, device=dev).tril().expand(b, n, n)
            variants = {"chain": (None, None, chain)}
            # The mask and its offsets as a DDTREE round sends them (draft_tree.verify_inputs).
            roots = torch.zeros((b,), dtype=torch.int64, device=dev)
            prefix_lens = torch.full((b,), prefix, dtype=torch.int64, device=dev)
            for name, sharpness in (("chain_mask", 60.0), ("tree", None)):
                built = tree(b, n, sharpness, gen, dev)
                inputs = dt.verify_inputs(built, roots, prefix_lens)
                variants[name] = (inputs.tree_mask, inputs.mask_indptr, built.visibility)
            if not torch.equal(variants["chain_mask"][2], chain):
                raise SystemExit("the sharp rows did not give the rank-0 chain")
            outs = {name: torch.empty_like(q) for name in variants}

            def launch(name):
                mask, indptr, _ = variants[name]
                fwd(q, k_ext, v_ext, outs[name], k_buf, v_buf, qo_indptr, kv_indptr,
                    kv_indices, mask, True, indptr, n, 1.0, 1.0, scale)  # fmt: skip

            row = {"batch": b, "prefix": prefix, "width": n}
            for name, (_, _, vis) in variants.items():
                launch(name)
                ref = reference(q, k_buf, v_buf, b, n, prefix, vis, scale)
                err = float((outs[name].float() - ref.float()).abs().max())
                row[f"{name}_max_err"] = round(err, 5)
                ok &= err < 0.05
            graphs = {}
            try:
                if dev.type == "cuda":
                    graphs = {name: draft_tree_gpu.capture(lambda name=name: launch(name))[0]
                              for name in variants}  # fmt: skip
            except RuntimeError as exc:  # eager times only, and why
                row["graph_error"] = str(exc).splitlines()[0][:300]
            if graphs:  # the replay writes what the launch wrote
                for name, graph in graphs.items():
                    before = outs[name].clone()
                    outs[name].zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    ok &= torch.equal(outs[name], before)
            times = {f"{name}{kind}": [] for name in variants for kind in ("", "_eager")}
            for _ in range(args.repeats if dev.type == "cuda" else 0):
                for name in variants:
                    if graphs:
                        times[name].append(draft_tree_gpu.block_us(graphs[name].replay, args.iters))
                    times[f"{name}_eager"].append(
                        draft_tree_gpu.block_us(lambda: launch(name), args.iters)
                    )
            for name, ts in times.items():
                if ts:
                    row[f"{name}_us"] = round(statistics.median(ts), 2)
            if "tree_us" in row and "chain_us" in row:
                row["tree_over_chain"] = round(row["tree_us"] / row["chain_us"], 3)
                row["mask_over_chain"] = round(row["chain_mask_us"] / row["chain_us"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else str(dev)
        args.json.write_text(json.dumps({"device": name,
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
