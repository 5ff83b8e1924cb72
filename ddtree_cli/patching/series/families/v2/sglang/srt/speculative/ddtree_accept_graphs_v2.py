"""The accept of a DDTREE v2 round (tree walk, commit and KV move) replayed from CUDA graphs.

After the target's verify a v2 round walks each tree (``ddtree_tree.verify_walk``), computes
what it commits (``ddtree_commit_v2.commit_round``) and moves the accepted path's KV to the
front of each verify window (the KV pool's ``move_kv_cache``): three Triton launches with
about fifteen output allocations, all from Python, on the path where a round with a small
target is bound by the host (docs/validation.md, the nineteenth GPU run: the walk's and the
commit's wrappers were most of what DDTREE's round adds to DFLASH's). Their shapes depend
only on the batch size and the verify width, and they read the tree the round graph built
(``ddtree_round_graphs``) from that graph's own buffers, so they can be captured once per
round-graph batch size and replayed with one launch.

``AcceptGraphs`` holds, per captured batch size ``S``, two graphs (the outputs of a round
must stay valid while the next round runs, as DFlash's double-buffered accept outputs do:
the committed lengths become the next round's prefix) over one static input buffer each:
the target's token per node ``[S, D]``, the window's KV slots ``[S * D]`` and the committed
prefix ``[S]``. A round of ``bs <= S`` requests that replayed the size-``S`` round graph
copies its inputs into the first ``bs`` rows (one multi-tensor copy) and replays; the graph
clears its input buffer as its last step, so the rows past ``bs`` hold slot 0 (the pool's
padding slot: their KV moves copy slot 0 onto itself, as the eager commit's rows past the
accepted path do). The outputs are the graph's buffers cut to ``bs`` rows. A round that did
not replay a round graph, or whose inputs have other dtypes, runs eagerly.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from sglang.srt.speculative.ddtree_round_graphs import RoundGraphsError, cuda_capture, cuda_pool

# The accept's outputs, in this order: matched drafts [bs], committed lengths [bs], bonus
# tokens [bs], emitted tokens [bs, W], new sequence lengths [bs], hidden rows [bs * W].
AcceptOutputs = Tuple[Any, Any, Any, Any, Any, Any]

SLOTS = 2


class AcceptGraphs:
    """``accept(tree, target, prefix, locs)`` per (round-graph batch size, slot); see the
    module's docstring. ``capture_fn`` / ``pool_fn`` default to CUDA graphs (tests pass
    stand-ins that replay by calling)."""

    def __init__(
        self,
        accept: Callable[[Any, Any, Any, Any], AcceptOutputs],
        *,
        width: int,
        device: Any,
        capture_fn: Optional[Callable] = None,
        pool_fn: Optional[Callable] = None,
    ):
        self.accept = accept
        self.width = int(width)
        self.device = device
        self._capture = capture_fn or cuda_capture
        self._pool = (pool_fn or cuda_pool)()
        # (size, slot) -> (target, locs, prefix, whole input buffer, replay, outputs)
        self._graphs: Dict[Tuple[int, int], Tuple[Any, Any, Any, Any, Callable, Any]] = {}
        self._slot = 0
        self.replays = 0  # rounds served from a graph
        self.eager = 0  # rounds that had none

    def _inputs(self, size: int):
        """One zeroed int64 buffer viewed as the three contiguous inputs."""
        import torch

        d = self.width
        whole = torch.zeros((2 * size * d + size,), dtype=torch.int64, device=self.device)
        target = whole[: size * d].view(size, d)
        locs = whole[size * d : 2 * size * d]
        prefix = whole[2 * size * d :]
        return target, locs, prefix, whole

    def capture(self, sizes_and_trees: Sequence[Tuple[int, Any]]) -> int:
        """Capture both slots for every ``(size, tree)``: ``tree`` is the size-``size``
        round graph's tree buffers (all ``size`` rows). Each graph is run once eagerly
        first. A capture that fails drops every graph held and raises ``RoundGraphsError``
        with the cause. Returns how many graphs were captured."""
        done = 0
        for size, tree in sizes_and_trees:
            for slot in range(SLOTS):
                key = (int(size), slot)
                if key in self._graphs:
                    continue
                target, locs, prefix, whole = self._inputs(int(size))

                def fn(tree=tree, target=target, locs=locs, prefix=prefix, whole=whole):
                    out = self.accept(tree, target, prefix, locs)
                    # The next round's rows past its batch must move nothing: slot 0.
                    whole.zero_()
                    return out

                try:
                    fn()
                    replay, out = self._capture(fn, self._pool)
                except Exception as exc:
                    self._graphs.clear()
                    raise RoundGraphsError(
                        f"capturing the accept at batch size {size}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                self._graphs[key] = (target, locs, prefix, whole, replay, out)
                done += 1
        return done

    def __call__(
        self, size: Optional[int], target: Any, prefix: Any, locs: Any
    ) -> Optional[AcceptOutputs]:
        """The accept of a round of ``target [bs, D]`` that replayed the size-``size``
        round graph (None: it ran eagerly), or None where there is no graph for it (the
        caller then runs ``accept`` itself)."""
        import torch

        entry = None if size is None else self._graphs.get((int(size), self._slot))
        bs = int(target.shape[0])
        if (
            entry is None
            or bs > int(size)
            or tuple(target.shape) != (bs, self.width)
            or any(t.dtype != torch.int64 for t in (target, prefix, locs))
            or locs.numel() != bs * self.width
        ):
            self.eager += 1
            return None
        self._slot = (self._slot + 1) % SLOTS
        t_in, l_in, p_in, _, replay, out = entry
        torch._foreach_copy_(
            [t_in[:bs], l_in[: bs * self.width], p_in[:bs]],
            [target, locs.reshape(-1), prefix],
        )
        replay()
        self.replays += 1
        if bs == int(size):
            return out
        w = out[3].shape[1]
        return (out[0][:bs], out[1][:bs], out[2][:bs], out[3][:bs], out[4][:bs],
                out[5][: bs * w])  # fmt: skip

    def snapshot(self) -> dict:
        """For ``/server_info``: the graphs held and how many rounds used them."""
        return {
            "graphs": len(self._graphs),
            "sizes": sorted({size for size, _ in self._graphs}),
            "replayed_rounds": self.replays,
            "eager_rounds": self.eager,
        }
