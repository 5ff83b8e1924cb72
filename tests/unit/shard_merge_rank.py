"""One tensor-parallel rank of the shard-merge test (tests/unit/test_draft_tree_tp.py).

Run as ``python -m tests.unit.shard_merge_rank RANK WORLD PORT CASES OUT``. The rank joins a
gloo process group through the parent's TCP store on 127.0.0.1:PORT, then for every case in
the CASES file does what the patched SGLang draft head (``draft_topk_logprobs`` in
``ddtree_utils.py`` of the patch series) does with tensor parallelism: rank the logits of its
vocabulary shard chunk by chunk with ``shard_topk``, all-gather the top-K logits, ids and
log-sum-exps into ``[world * rows, ...]`` tensors (SGLang's ``GroupCoordinator.
all_gather_into_tensor``, which is ``torch.distributed.all_gather_into_tensor`` on the group,
or pynccl's all-gather with the same layout: rank-major along dim 0), merge with
``merge_shard_topk`` and build the tree from the merged top-K. It saves what it got to
OUT/rank{RANK}.pt, or a traceback to OUT/rank{RANK}.err.
"""

from __future__ import annotations

import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ddtree_cli import draft_tree as dt

TIMEOUT = timedelta(seconds=20)
CHUNK_ROWS = 4  # the head's chunk_size, small so that a case spans several chunks


def sglang_org_vocab_shard(vocab: int, rank: int, world: int, pad_to: int = 64) -> range:
    """The ids a rank's LM head holds, as SGLang 0.5.13's VocabParallelEmbedding lays them out
    (``pad_vocab_size`` and ``_get_indices`` in ``layers/vocab_parallel_embedding.py``): the
    vocabulary is padded to a multiple of 64 (times the TP size when that does not divide),
    split evenly, and the padding removed, so the last rank holds fewer ids."""

    def pad(n: int, to: int) -> int:
        return -(-n // to) * to

    padding = pad_to * world if pad(vocab, pad_to) % world else pad_to
    per_rank = pad(vocab, padding) // world
    return range(min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab))


def merged_topk(logits: torch.Tensor, k: int, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    b, n_pos, vocab = logits.shape
    ids = sglang_org_vocab_shard(vocab, rank, world)
    rows = logits.reshape(-1, vocab)[:, ids.start : ids.stop]
    values, top_ids, lses = [], [], []
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        v, i, lse = dt.shard_topk(rows[start : start + CHUNK_ROWS].unsqueeze(0), k, ids.start)
        values.append(v.squeeze(0))
        top_ids.append(i.squeeze(0))
        lses.append(lse.squeeze(0))
    local = [torch.cat(values).contiguous(), torch.cat(top_ids).contiguous()]
    local_lse = torch.cat(lses).contiguous()
    n_rows, kk = local[0].shape
    gathered = []
    for t in (*local, local_lse):
        out = t.new_empty((world * n_rows, *t.shape[1:]))
        dist.all_gather_into_tensor(out, t)
        gathered.append(out.view(world, *t.shape))
    lp, merged_ids = dt.merge_shard_topk(*gathered, k)
    return lp.view(b, n_pos, -1), merged_ids.view(b, n_pos, -1)


def main(rank: int, world: int, port: int, cases_path: Path, out: Path) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        results = {}
        for name, case in torch.load(cases_path).items():
            lp, ids = merged_topk(case["logits"], case["budget"], rank, world)
            tree = dt.build_tree_from_topk(lp, ids, case["budget"], use_triton=False)
            results[name] = {
                "logprobs": lp,
                "ids": ids,
                "tree": {f: getattr(tree, f) for f in TREE_FIELDS},
                "shard": shard_bounds(case["logits"].shape[-1], rank, world),
            }
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def shard_bounds(vocab: int, rank: int, world: int) -> list[int]:
    ids = sglang_org_vocab_shard(vocab, rank, world)
    return [ids.start, ids.stop]


TREE_FIELDS = ("tokens", "parents", "depths", "visibility", "num_nodes", "scores")

if __name__ == "__main__":
    r, w, p, cases_file, out_dir = sys.argv[1:6]
    try:
        main(int(r), int(w), int(p), Path(cases_file), Path(out_dir))
    except BaseException:
        (Path(out_dir) / f"rank{r}.err").write_text(traceback.format_exc())
        raise
