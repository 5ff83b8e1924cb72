"""The draft head and the tree build of a DDTREE round, replayed from CUDA graphs.

Between the draft's graph replay and the target's, a DDTREE round runs the draft head (the
target's LM head over the drafted positions, then the top-K log-probs: a matrix product and
two Triton launches per 256 rows) and the tree build (one Triton launch), each with its
output allocations, from Python: on the H200 the round's build (these and the verify inputs)
took about 1 ms of host time, about 9 % of a batch-1 round. Their shapes depend only on the
batch size, the head's K and the budget, so they can be captured once per
(batch size, K, budget) and replayed with one launch.

``DraftRoundGraphs`` captures them at start-up (``capture_round_graphs``, both layouts'
workers) for the batch sizes the target's CUDA graphs cover. A round of batch ``bs`` replays the graph of the smallest captured size >= ``bs``:
the drafted hidden states are copied into the graph's input rows, the rows past ``bs`` keep
whatever they held (requests are independent in the head and the tree), and the outputs
are the graph's own buffers cut to ``bs`` rows, valid until the next replay of ANY round
graph (the next round): all graphs share one memory pool, so a graph captured later may hold
its outputs where an earlier one writes its intermediates, and replaying the earlier one
overwrites them (on an H100 a tree read after another budget's graph replayed sent the walk
out of bounds; ``benchmarks/step_graphs_gpu.py``). Whoever reads a graph's buffers outside
the round that replayed it calls ``replay_captured`` first. Anything it has no graph for runs
eagerly, as before.

On by default in both layouts' workers (``SGLANG_DDTREE_ROUND_GRAPHS`` 0 or 1 overrides
the default, ``round_graphs_requested``); one rank only (the head's tensor-parallel merge is
a collective, not captured here). On the H200 (0.5.13, spec v1, docs/performance.md) the
replayed rounds matched the eager ones, the build's host time fell from 1.0-1.1 ms to
0.4-0.5 ms p50, and two maps of the 8B-cost pair at concurrency 1-32 with graph servers had
DDTREE at budget 15 and ``auto`` at or above DFLASH everywhere. On an H100 (0.5.17, spec v2,
docs/validation.md, the seventeenth run) every round replayed and budget 15 went from 0.79x
to 0.88x DFLASH at concurrency 1 on the trained pair.

``warm_rounds`` is the start-up warm-up both workers run before serving, graphs or not: the
round's eager part once per budget and batch size, so that its Triton kernels compile
before the first request rather than in it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

ENV = "SGLANG_DDTREE_ROUND_GRAPHS"


class RoundGraphsError(RuntimeError):
    """A capture failed; no graph is held any more."""


ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def round_graphs_requested(
    default: bool = False, env: str = ENV, what: str = "round graphs"
) -> bool:
    """Whether to capture the round graphs: ``SGLANG_DDTREE_ROUND_GRAPHS`` on (1, true, yes,
    on) or off (0, false, no, off); unset or empty, ``default`` (the worker's; both
    layouts' are on). Anything else keeps the default, with a warning. ``env`` and ``what``
    ask the same of another switch (the v2 worker's step graphs, ``ddtree_step_graphs_v2``)."""
    value = os.environ.get(env, "").strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    if value:
        logger.warning(
            "%s=%r is neither on (%s) nor off (%s): %s %s (the default)",
            env, value, "/".join(ON), "/".join(OFF), what, "on" if default else "off",
        )  # fmt: skip
    return default


def cuda_capture(fn: Callable[[], Any], pool: Any) -> Tuple[Callable[[], None], Any]:
    """Capture ``fn()`` into a CUDA graph: (replay, the outputs captured)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def cuda_pool() -> Any:
    import torch

    return torch.cuda.graph_pool_handle()


def _rows(tree: Any, bs: int) -> Any:
    """A DraftTree's first ``bs`` requests (views of its buffers)."""
    import dataclasses

    return dataclasses.replace(
        tree,
        tokens=tree.tokens[:bs],
        parents=tree.parents[:bs],
        depths=tree.depths[:bs],
        visibility=tree.visibility[:bs],
        num_nodes=tree.num_nodes[:bs],
        scores=None if tree.scores is None else tree.scores[:bs],
    )


class DraftRoundGraphs:
    """``head(hidden, K)`` then ``build(log-probs, ids, budget)``, one graph per
    (captured batch size, K, budget); see the module's docstring.

    ``head`` maps hidden states ``[bs, L, H]`` and K to ``(logprobs, ids)`` ``[bs, L, K]``;
    ``build`` is ``ddtree_tree.build_tree_from_topk``. ``capture_fn`` / ``pool_fn`` default
    to CUDA graphs (tests pass stand-ins that replay by calling)."""

    def __init__(
        self,
        head: Callable[[Any, int], Tuple[Any, Any]],
        build: Callable[[Any, Any, int], Any],
        *,
        sizes: Iterable[int],
        n_pos: int,
        hidden_size: int,
        dtype: Any,
        device: Any,
        capture_fn: Optional[Callable] = None,
        pool_fn: Optional[Callable] = None,
    ):
        self.head = head
        self.build = build
        self.sizes = sorted({int(s) for s in sizes if int(s) > 0})
        self.n_pos = int(n_pos)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.device = device
        self._capture = capture_fn or cuda_capture
        self._pool = (pool_fn or cuda_pool)()
        self._graphs: Dict[Tuple[int, int, int], Tuple[Any, Callable[[], None], Any]] = {}
        self.replays = 0  # rounds served from a graph
        self.eager = 0  # rounds that had none
        # The captured batch size the last round replayed, None when it ran eagerly (the
        # v2 worker's accept graphs read the tree from that graph's buffers).
        self.last_size: Optional[int] = None

    def eager_round(self, hidden: Any, k: int, budget: int) -> Tuple[Any, Any, Any]:
        logprobs, ids = self.head(hidden, k)
        return logprobs, ids, self.build(logprobs, ids, budget)

    def capture(self, k: int, budget: int) -> int:
        """Capture (K, budget) at every size; returns how many graphs were captured. Each
        is run once eagerly first (compiled kernels, cached tables, library handles). A
        capture that fails drops every graph held (all rounds run eagerly, as without
        them) and raises ``RoundGraphsError`` with the cause."""
        import torch

        done = 0
        for size in self.sizes:
            key = (size, int(k), int(budget))
            if key in self._graphs:
                continue
            static = torch.zeros(
                (size, self.n_pos, self.hidden_size), dtype=self.dtype, device=self.device
            )

            def fn(static=static, k=k, budget=budget):
                return self.eager_round(static, k, budget)

            try:
                fn()
                replay, out = self._capture(fn, self._pool)
                # A captured graph's outputs hold nothing until it runs: one replay, so
                # that its tree is a real one before any round (the v2 worker's step
                # graphs are captured on these buffers and run once when captured; a
                # walk over uninitialised parents reads out of bounds).
                replay()
            except Exception as exc:
                self._graphs.clear()
                raise RoundGraphsError(
                    f"capturing batch size {size}, K {k}, budget {budget}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            self._graphs[key] = (static, replay, out)
            done += 1
        return done

    def replay_captured(self, size: int, k: int, budget: int) -> None:
        """Replay the size-``size`` graph at (K, budget) on whatever its input holds, so that
        its buffers are its own again (another graph's replay may have written over them:
        the module's docstring); the v2 worker's step graphs call it before they capture on
        this graph's tree."""
        self._graphs[(int(size), int(k), int(budget))][1]()

    def size_for(self, bs: int) -> Optional[int]:
        return next((s for s in self.sizes if s >= bs), None)

    def __call__(self, hidden: Any, k: int, budget: int) -> Tuple[Any, Any, Any]:
        """This round's ``(logprobs, ids, tree)`` for ``hidden [bs, L, H]``."""
        bs = int(hidden.shape[0])
        size = self.size_for(bs)
        entry = None if size is None else self._graphs.get((size, int(k), int(budget)))
        if entry is None or tuple(hidden.shape[1:]) != (self.n_pos, self.hidden_size):
            self.eager += 1
            self.last_size = None
            return self.eager_round(hidden, k, budget)
        static, replay, (logprobs, ids, tree) = entry
        static[:bs].copy_(hidden)
        replay()
        self.replays += 1
        self.last_size = size
        if size == bs:
            return logprobs, ids, tree
        return logprobs[:bs], ids[:bs], _rows(tree, bs)

    def captured_trees(self, k: int, budget: int) -> List[Tuple[int, Any]]:
        """``(size, tree)`` for every captured size at (K, budget): the tree buffers the
        size's graph writes, all ``size`` rows."""
        return [
            (size, entry[2][2])
            for (size, kk, bb), entry in sorted(self._graphs.items())
            if (kk, bb) == (int(k), int(budget))
        ]

    def snapshot(self) -> dict:
        """For ``/server_info``: the graphs held and how many rounds used them."""
        return {
            "graphs": len(self._graphs),
            "sizes": list(self.sizes),
            "replayed_rounds": self.replays,
            "eager_rounds": self.eager,
        }


def graph_batch_sizes(model_runner: Any) -> List[int]:
    """The batch sizes the target's decode CUDA graphs cover (spec v1 keeps that runner as
    ``graph_runner``, v2 as ``decode_cuda_graph_runner``); 1, 2 and 16 without graphs."""
    for name in ("graph_runner", "decode_cuda_graph_runner"):
        sizes = getattr(getattr(model_runner, name, None), "capture_bs", None)
        if sizes:
            return sorted({int(s) for s in sizes})
    return [1, 2, 16]


def draft_round(lm_head: Any, tp_group: Any) -> Tuple[Callable, Callable]:
    """The round's head and build as the workers run them: ``ddtree_utils.draft_topk_logprobs``
    over ``lm_head`` (merged over ``tp_group``'s ranks), then ``ddtree_tree``'s tree."""
    from sglang.srt.speculative import ddtree_tree
    from sglang.srt.speculative.ddtree_utils import draft_topk_logprobs

    def head(hidden, k):
        return draft_topk_logprobs(hidden, lm_head, k, tp_group)

    return head, ddtree_tree.build_tree_from_topk


def _tp_size(tp_group: Any) -> int:
    return int(getattr(tp_group, "world_size", 1) or 1)


def warm_rounds(
    lm_head: Any,
    tp_group: Any,
    after: Optional[Callable[[Any, int, int], None]],
    *,
    sizes: Sequence[int],
    budgets: Sequence[int],
    n_pos: int,
    device: Any,
    log: bool = True,
) -> List[Tuple[int, int]]:
    """The round's eager part (``draft_round``) on zero hidden states once per batch size
    and budget: the head at K = budget, the tree, then ``after(tree, bs, budget)`` (the
    layout's verify inputs and whatever else its rounds launch); logged with its time when
    ``log``. Returns the (batch size, budget) pairs run."""
    import torch

    head, build = draft_round(lm_head, tp_group)
    started = time.perf_counter()
    warmed = []
    with torch.inference_mode():
        for bs in sizes:
            hidden = torch.zeros(
                (bs, n_pos, lm_head.weight.shape[1]), dtype=lm_head.weight.dtype, device=device
            )
            for budget in budgets:
                logprobs, ids = head(hidden, budget)
                tree = build(logprobs, ids, budget)
                if after is not None:
                    after(tree, bs, budget)
                warmed.append((int(bs), int(budget)))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    if log:
        logger.info(
            "DDTREE eager kernels warmed: budgets %s x batch sizes %s in %.1f s",
            list(budgets),
            list(sizes),
            time.perf_counter() - started,
        )
    return warmed


def _why_not(lm_head: Any, tp_size: int, device: Any) -> Optional[str]:
    """Why a worker cannot capture round graphs, None when it can."""
    import torch

    if lm_head is None or not hasattr(lm_head, "weight"):
        return "the target has no vocab-parallel lm_head"
    if tp_size > 1:
        return f"tensor parallelism ({tp_size} ranks): the head's merge is a collective"
    if torch.device(device).type != "cuda":
        return "not on a CUDA device"
    return None


def capture_round_graphs(
    lm_head: Any,
    tp_group: Any,
    *,
    sizes: Sequence[int],
    pairs: Sequence[Tuple[int, int]],
    n_pos: int,
    device: Any,
    log: bool = True,
) -> Optional[DraftRoundGraphs]:
    """A worker's round graphs (``draft_round``): one per batch size and (K, budget) in
    ``pairs``, or None (with a warning when ``log``) where they do not apply (no
    vocab-parallel head, more than one rank, not CUDA) or a capture fails: the worker then
    serves eagerly, as without them."""
    import torch

    why = _why_not(lm_head, _tp_size(tp_group), device)
    if why is not None:
        if log:
            logger.warning("DDTREE round graphs not used: %s.", why)
        return None
    started = time.perf_counter()
    # no_grad, not inference_mode: the graphs' buffers must take the in-place copy of each
    # round's hidden states whatever grad mode the scheduler serves under.
    try:
        graphs = DraftRoundGraphs(
            *draft_round(lm_head, tp_group),
            sizes=sizes,
            n_pos=n_pos,
            hidden_size=lm_head.weight.shape[1],
            dtype=lm_head.weight.dtype,
            device=device,
        )
        with torch.no_grad():
            for k, budget in pairs:
                graphs.capture(k, budget)
    except (RuntimeError, AssertionError) as exc:
        # A failed capture (RoundGraphsError) drops every graph; the buffers or the pool may
        # fail to exist at all.
        if log:
            logger.warning("DDTREE round graphs not used: %s", exc)
        return None
    torch.cuda.synchronize(device)
    if log:
        logger.info(
            "DDTREE round graphs: %d captured (head + tree; (K, budget) %s x batch sizes "
            "%s) in %.1f s",
            graphs.snapshot()["graphs"],
            [tuple(p) for p in pairs],
            list(graphs.sizes),
            time.perf_counter() - started,
        )
    return graphs
