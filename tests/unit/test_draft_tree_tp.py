"""The tensor-parallel shard merge across two real processes (gloo on 127.0.0.1).

Each rank holds its vocabulary shard, laid out as SGLang's vocab-parallel LM head lays it out
(uneven: the last rank holds fewer ids), and runs the patched draft head's TP path
(tests/unit/shard_merge_rank.py). The merged top-K and the tree built from it are compared
with the unsharded ``topk_logprobs`` / ``build_tree`` on the whole vocabulary.

What "equal" means when logits tie. Neither path promises an order among equal logits:
``torch.topk`` returns tied ids in an unspecified order (on the CPU not even ascending) and
the Triton kernels in another. So the contract, checked here, is:
  * the log-probabilities are the same rank by rank (up to the rounding of the log-sum-exp),
    and so are the raw logits of the chosen ids, exactly;
  * every id whose logit is above the K-th largest is chosen by both; at the K-th value any
    of the tied ids may be chosen; the ids of a row are distinct;
  * where a row's top K+1 logits are all distinct the ids are identical;
  * the trees have the same shape (parents, depths, visibility, node counts) and scores, and
    each node's token has the same draft logit at its position as the unsharded tree's; the
    tokens are identical where no position of the request has a tie;
  * every rank ends with bit-identical results (the ranks must verify the same tree).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddtree_cli import draft_tree as dt
from tests.unit.shard_merge_rank import TREE_FIELDS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in"),
]

WORLD = 2
REPO = Path(__file__).resolve().parents[2]
RUN_LIMIT_S = 90  # generous: the ranks' own collectives time out after 20 s


def ties_across_boundary() -> torch.Tensor:
    """Integer logits (exact ties) around id 512, where SGLang's layout splits 1001 ids over
    two ranks; budget 6."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-20, -10, (1, 4, 1001), generator=gen).float()
    x[0, 0, 508:516] = 5.0  # 8 tied at the top, 4 per shard: the cut falls inside the tie
    x[0, 1, [100, 600, 300]] = torch.tensor([9.0, 8.0, 7.0])
    x[0, 1, [5, 511, 512, 700]] = 6.0  # 3 of these 4 make the top 6
    x[0, 2, [511, 512]] = 9.0  # a tie inside the top K, one id per shard
    x[0, 2, [0, 1000]] = 8.0
    x[0, 3] = 0.0  # the whole row tied
    return x


def masked() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 1001, generator=gen)
    x[0, 0, 512:] = float("-inf")  # rank 1's whole shard masked
    x[0, 1] = float("-inf")
    x[0, 1, [2, 700, 900]] = torch.tensor([1.0, 3.0, 2.0])  # fewer finite logits than K
    return x


def cases() -> dict[str, dict]:
    gen = torch.Generator().manual_seed(20)
    return {
        "random_uneven": {"logits": torch.randn(2, 5, 1001, generator=gen) * 3, "budget": 24},
        "bf16_uneven": {
            "logits": (torch.randn(2, 5, 1001, generator=gen) * 4).bfloat16(),
            "budget": 32,
        },
        "small_vocab": {"logits": torch.randn(3, 4, 97, generator=gen) * 2, "budget": 16},
        # The trained engine pair (vocabulary 260: 160 + 100 ids at TP 2), block 16, budget
        # 64, as the two-GPU run will serve it.
        "trained_pair_layout": {"logits": torch.randn(2, 15, 260, generator=gen) * 3, "budget": 64},
        "ties_across_boundary": {"logits": ties_across_boundary(), "budget": 6},
        "masked": {"logits": masked(), "budget": 8},
    }


CASES = cases()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' results; the parent hosts the rendezvous store on a free port."""
    work = tmp_path_factory.mktemp("tp")
    torch.save(CASES, work / "cases.pt")
    store = dist.TCPStore(
        "127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    args = [str(WORLD), str(store.port), str(work / "cases.pt"), str(work)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.unit.shard_merge_rank", str(rank), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=RUN_LIMIT_S)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the ranks did not finish within {RUN_LIMIT_S} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [
        f"rank {rank} exited {proc.returncode}:\n"
        + ((work / f"rank{rank}.err").read_text() if (work / f"rank{rank}.err").exists() else out)
        for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True))
        if proc.returncode != 0
    ]
    if failed:
        pytest.fail("\n".join(failed))
    return [torch.load(work / f"rank{rank}.pt") for rank in range(WORLD)]


def tie_free(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: are the top ``k + 1`` logits all distinct (so the top K ids are unique)?"""
    top = logits.float().topk(min(k + 1, logits.shape[-1]), dim=-1).values
    return (top[..., 1:] != top[..., :-1]).all(-1)


def node_logits(logits: torch.Tensor, tree: dict) -> torch.Tensor:
    """The draft logit of each drafted node's token at its position (padding: its token)."""
    depth = tree["depths"][:, 1:]
    pos = (depth - 1).clamp_min(0)
    rows = torch.arange(logits.shape[0])[:, None]
    got = logits.float()[rows, pos, tree["tokens"]]
    return torch.where(depth > 0, got, tree["tokens"].float())


def test_the_shards_are_uneven(ranks):
    assert [r["random_uneven"]["shard"] for r in ranks] == [[0, 512], [512, 1001]]
    assert [r["small_vocab"]["shard"] for r in ranks] == [[0, 64], [64, 97]]
    assert [r["trained_pair_layout"]["shard"] for r in ranks] == [[0, 160], [160, 260]]


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_gets_the_same_result(ranks, name):
    first, other = ranks[0][name], ranks[1][name]
    assert torch.equal(first["logprobs"], other["logprobs"])
    assert torch.equal(first["ids"], other["ids"])
    for f in TREE_FIELDS:
        assert torch.equal(first["tree"][f], other["tree"][f]), f


@pytest.mark.parametrize("name", list(CASES))
def test_merged_topk_equals_unsharded(ranks, name):
    logits, k = CASES[name]["logits"], CASES[name]["budget"]
    got_lp, got_ids = ranks[0][name]["logprobs"], ranks[0][name]["ids"]
    want_lp, want_ids = dt.topk_logprobs(logits, k, use_triton=False)
    assert got_lp.shape == want_lp.shape
    assert torch.allclose(got_lp, want_lp, rtol=0, atol=1e-5)
    got_v, want_v = logits.gather(-1, got_ids), logits.gather(-1, want_ids)
    assert torch.equal(got_v, want_v)  # the same logit at every rank, exactly
    assert (got_ids.sort(-1).values.diff(dim=-1) != 0).all()  # distinct ids
    # Distinct ids, as many above the K-th logit as the vocabulary holds: all of those ids.
    kth = want_v[..., -1:]
    above = (logits > kth).sum(-1)
    assert torch.equal((got_v > kth).sum(-1), above) and torch.equal((want_v > kth).sum(-1), above)
    exact = tie_free(logits, k)
    assert torch.equal(got_ids[exact], want_ids[exact])


@pytest.mark.parametrize("name", list(CASES))
def test_tree_from_merged_topk_equals_unsharded_tree(ranks, name):
    logits, budget = CASES[name]["logits"], CASES[name]["budget"]
    got = ranks[0][name]["tree"]
    want_tree = dt.build_tree(logits, budget, use_triton=False)
    want = {f: getattr(want_tree, f) for f in TREE_FIELDS}
    for f in ("parents", "depths", "visibility", "num_nodes"):
        assert torch.equal(got[f], want[f]), f
    assert torch.allclose(got["scores"], want["scores"], rtol=1e-6, atol=1e-4)
    assert torch.equal(node_logits(logits, got), node_logits(logits, want))
    exact = tie_free(logits, budget).all(-1)
    assert torch.equal(got["tokens"][exact], want["tokens"][exact])


def test_the_tie_cases_do_cross_the_boundary(ranks):
    """The tie case is meaningful: the chosen tied ids come from both shards."""
    ids = ranks[0]["ties_across_boundary"]["ids"][0]
    chosen = set(ids[0].tolist())
    assert len(chosen) == 6 and chosen <= set(range(508, 516))
    assert {i < 512 for i in chosen} == {True, False}
    assert {511, 512} <= set(ids[2, :2].tolist())
