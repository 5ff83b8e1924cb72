"""Steps of a DDTREE v2 round replayed from CUDA graphs on the round graphs' buffers.

Around the target's verify a v2 round builds the verify inputs from the tree
(``ddtree_tree.verify_inputs``: tokens, positions and the tree mask, one Triton launch) and,
after it, accepts: walks each tree (``ddtree_tree.verify_walk``), computes what it commits
(``ddtree_commit_v2.commit_round``) and moves the accepted path's KV to the front of each
verify window (the KV pool's ``move_kv_cache``). Each is Triton launches and a dozen output
allocations from Python, on the path where a round with a small target is bound by the host
(docs/validation.md, the nineteenth and twentieth GPU runs). Their shapes depend only on the
batch size and the verify width, and they read the tree the round graph built
(``ddtree_round_graphs``) from that graph's own buffers, so each can be captured once per
round-graph batch size and replayed with one launch.

``StepGraphs`` holds, per captured batch size ``S`` and slot, one graph of a step
``fn(tree, *inputs)`` over one static int64 input buffer: per input ``[S]`` or ``[S, w]``
(``row_widths``). A round of ``bs <= S`` requests that replayed the size-``S`` round graph
copies its inputs into the first ``bs`` rows (one multi-tensor copy) and replays; the graph
clears its input buffer as its last step, so the rows past ``bs`` hold zeros the next time
(for the accept: slot 0, the pool's padding slot, whose moves copy slot 0 onto itself, as the
eager commit's rows past the accepted path do; for the verify inputs: an empty prefix). The
outputs are the graph's buffers cut to ``bs`` rows. ``slots`` graphs per size are replayed in
turn, so that a round's outputs stay valid while the next round runs (the accept: its
committed lengths become the next round's prefix, as DFlash's double-buffered accept outputs
do; each slot's graphs have a memory pool of their own, so that replaying one slot's graph
cannot write over the other's outputs). A round that did not replay a round graph, or whose
inputs have another dtype or shape, runs the step eagerly.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from sglang.srt.speculative.ddtree_round_graphs import RoundGraphsError, cuda_capture, cuda_pool

# The v2 worker's switches (with the round graphs only): the accept's and the verify inputs'
# graphs, each on unless its switch is off.
ACCEPT_ENV = "SGLANG_DDTREE_ACCEPT_GRAPHS"
VERIFY_ENV = "SGLANG_DDTREE_VERIFY_GRAPHS"


class StepGraphs:
    """``fn(tree, *inputs)`` per (round-graph batch size, slot); see the module's docstring.
    ``fn`` returns a tuple of tensors whose first dimension is the batch; ``name`` is what
    errors call it. ``capture_fn`` / ``pool_fn`` default to CUDA graphs (tests pass
    stand-ins that replay by calling)."""

    def __init__(
        self,
        fn: Callable[..., Tuple[Any, ...]],
        *,
        name: str,
        row_widths: Sequence[int],
        slots: int,
        device: Any,
        capture_fn: Optional[Callable] = None,
        pool_fn: Optional[Callable] = None,
    ):
        self.fn = fn
        self.name = name
        self.row_widths = [int(w) for w in row_widths]
        self.slots = int(slots)
        self.device = device
        self._capture = capture_fn or cuda_capture
        # One memory pool per slot: graphs that share a pool may place one graph's outputs
        # where another's intermediates are written on replay, and a round's outputs must
        # outlive the next round's replay (of the other slot).
        self._pools = [(pool_fn or cuda_pool)() for _ in range(self.slots)]
        # (size, slot) -> (the inputs' views, the whole input buffer, replay, outputs)
        self._graphs: Dict[Tuple[int, int], Tuple[list, Any, Callable, Any]] = {}
        self._slot = 0
        self.replays = 0  # rounds served from a graph
        self.eager = 0  # rounds that had none

    def _inputs(self, size: int):
        """One zeroed int64 buffer, viewed as one contiguous ``[size]`` or ``[size, w]``
        tensor per input."""
        import torch

        whole = torch.zeros((size * sum(self.row_widths),), dtype=torch.int64, device=self.device)
        views, at = [], 0
        for w in self.row_widths:
            part = whole[at : at + size * w]
            views.append(part if w == 1 else part.view(size, w))
            at += size * w
        return views, whole

    def capture(self, round_graphs: Any, k: int, budget: int) -> int:
        """Capture every slot for every batch size ``round_graphs`` (a ``DraftRoundGraphs``)
        holds at (K, budget), on that size's tree buffers (all ``size`` rows), each size's
        round graph replayed first (``replay_captured``: another round graph's replay may
        have written over its buffers). Each graph is run once eagerly first. A capture that
        fails drops every graph held and raises ``RoundGraphsError`` with the cause. Returns
        how many graphs were captured."""
        done = 0
        for size, tree in round_graphs.captured_trees(k, budget):
            round_graphs.replay_captured(size, k, budget)
            for slot in range(self.slots):
                key = (int(size), slot)
                if key in self._graphs:
                    continue
                views, whole = self._inputs(int(size))

                def step(tree=tree, views=views, whole=whole):
                    out = self.fn(tree, *views)
                    whole.zero_()  # the next round's rows past its batch: zeros
                    return out

                try:
                    step()
                    replay, out = self._capture(step, self._pools[slot])
                except Exception as exc:
                    self._graphs.clear()
                    raise RoundGraphsError(
                        f"capturing the {self.name} at batch size {size}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                self._graphs[key] = (views, whole, replay, out)
                done += 1
        return done

    def __call__(self, size: Optional[int], inputs: Sequence[Any]) -> Optional[Tuple[Any, ...]]:
        """The step's outputs for ``inputs`` (``[bs]`` or ``[bs, w]`` each, as
        ``row_widths`` says) of a round that replayed the size-``size`` round graph (None:
        it ran eagerly), cut to ``bs`` rows; None where there is no graph for it (the
        caller then runs the step itself)."""
        import torch

        entry = None if size is None else self._graphs.get((int(size), self._slot))
        bs = int(inputs[0].shape[0])
        shapes = [(bs,) if w == 1 else (bs, w) for w in self.row_widths]
        if (
            entry is None
            or bs > int(size)
            or [tuple(t.shape) for t in inputs] != shapes
            or any(t.dtype != torch.int64 for t in inputs)
        ):
            self.eager += 1
            return None
        self._slot = (self._slot + 1) % self.slots
        views, _, replay, out = entry
        torch._foreach_copy_([v[:bs] for v in views], list(inputs))
        replay()
        self.replays += 1
        return out if bs == int(size) else tuple(t[:bs] for t in out)

    def snapshot(self) -> dict:
        """For ``/server_info``: the graphs held and how many rounds used them."""
        return {
            "graphs": len(self._graphs),
            "sizes": sorted({size for size, _ in self._graphs}),
            "replayed_rounds": self.replays,
            "eager_rounds": self.eager,
        }
