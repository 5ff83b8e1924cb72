"""DDTREE worker for spec v2: the DFlash v2 worker with a draft tree instead of a chain.

Prefill, the draft block forward, KV over-allocation, draft KV materialisation and the
scheduler protocol are DFlash's. The drafter runs its block (``block_size``, from
``speculative_dflash_block_size``); the target verifies the root plus ``budget`` nodes
(``verify_width = budget + 1 = speculative_num_draft_tokens``, at least the block). Both
windows start at the committed prefix, so the draft block's slots are the verify window's
first ``block_size`` columns. DDTREE overrides these seams of the decode round:

1. the draft head: per-position top-K log-probabilities (``ddtree_utils``) and a
   best-first tree under the node budget (``ddtree_tree.build_tree_from_topk``);
2. the verify input: tree tokens, ``prefix + depth`` positions and a FULL_MASK tree mask;
3. accept: the target's argmax per node (greedy) or one target sample per node (the
   output then follows the target exactly) walked by ``ddtree_tree.verify_walk``, then the
   accepted path's KV moves to the front of the verify window;
4. the committed target hidden states: the accepted path's rows, front-compacted, feed
   the draft KV materialisation (``block_size`` rows per request: the tree is at most
   ``block_size - 1`` deep, so the accepted path fits the draft block);
5. the widths: the drafter's block size and the verify window of ``verify_width`` slots.

Before serving (``init_cuda_graphs``, after the target's and the drafter's graphs are
captured) it runs the round's eager part once per batch size the target's CUDA graphs cover
(``ddtree_round_graphs.warm_rounds``), so that its Triton kernels compile then rather than in
the first request. By default (one rank, CUDA; ``SGLANG_DDTREE_ROUND_GRAPHS=0`` turns it
off) it first captures the draft head and the tree build per batch size
(``capture_round_graphs``) and replays them in ``_draft_next_tokens`` instead of launching
both from Python, as the v1 worker does (the capture before the warm-up: each capture
empties PyTorch's allocator caches). On an H100 with 0.5.17 and the trained pair the graph
server's rounds replayed every round and were faster than the eager server's
(docs/validation.md, the seventeenth GPU run). With them it captures, per round-graph
batch size, the accept (walk, commit, KV move: ``_accept``; ``SGLANG_DDTREE_ACCEPT_GRAPHS=0``
turns it off) and the verify inputs (into one mask buffer sized by the KV pool;
``SGLANG_DDTREE_VERIFY_GRAPHS=0`` turns them off), which a round that replayed a round graph
replays in ``_make_verify_input`` and ``_accept_block`` (``ddtree_step_graphs_v2``). On an
H100 (docs/validation.md, the twentieth and twenty-first GPU runs) every round replayed both,
with the same tokens as the eager verify inputs; with both, DDTREE's round at budget 15 came
within 1-5 % of DFLASH's (ITL p50) at concurrency 1 and 8 on both pairs.

Every decode round's host time is recorded (``forward_batch_generation``, into
``ddtree_round_timing.RoundTiming``) per batch bucket (``ddtree_budget_policy.batch_bucket``)
and verify width: the scheduler's gap, the whole forward and the build (the draft head, tree
and verify input: ``_draft_next_tokens`` + ``_make_verify_input``); the policy's time is 0,
as there is no budget policy here (``auto`` is refused). ``ddtree_internal_state()`` hands
it, and the round graphs' counters when they were captured, to the scheduler's
``get_internal_state`` (each release's ``scheduler.py`` hunk; from 0.5.22 the hunk is in the
scheduler's internal-state controller, where SGLang moved it), so that ``/server_info``
shows them as on 0.5.13.

The same file serves every v2 release (0.5.14 on). Where SGLang moved something between
them, this file looks for it rather than assuming one release: the DFlash worker's
constructor arguments are passed on as given, the resolved arguments are read from the
published spec config where there is one (0.5.17 on), the KV index plan (0.5.22 on) is
used when the target runner has one, and SGLang's cache-location kernel is imported from
where the release keeps it. The per-release seams live in each release's
``dflash_worker_v2.py`` hunks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Optional

import torch

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative import ddtree_budget_policy, ddtree_tree
from sglang.srt.speculative.ddtree_commit_v2 import (
    WINDOW_MOVE_CHECK,
    WINDOW_MOVE_ENV,
    accept_round,
    checked_kv_move,
    pool_move,
    window_kv_move,
)
from sglang.srt.speculative.ddtree_info_v2 import DDTreeVerifyInputV2
from sglang.srt.speculative.ddtree_round_graphs import (
    DraftRoundGraphs,
    RoundGraphsError,
    capture_round_graphs,
    graph_batch_sizes,
    round_graphs_requested,
    warm_rounds,
)
from sglang.srt.speculative.ddtree_round_timing import RoundTiming
from sglang.srt.speculative.ddtree_step_graphs_v2 import ACCEPT_ENV, VERIFY_ENV, StepGraphs
from sglang.srt.speculative.ddtree_utils import (
    check_ddtree_algorithm,
    draft_topk_logprobs,
    refuse_budget_auto,
    refuse_hybrid_target,
)
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_info import ddtree_draft_block_size

try:  # 0.5.16 on
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
except ImportError:  # 0.5.14, 0.5.15
    from sglang.srt.speculative.triton_ops.cache_locs import assign_extend_cache_locs_func
try:  # 0.5.17 on: the resolved arguments as the scheduler published them
    from sglang.srt.runtime_context import get_spec
except ImportError:  # 0.5.14 - 0.5.16 resolve ServerArgs in place: it is the record
    from sglang.srt.server_args import get_global_server_args as get_spec

logger = logging.getLogger(__name__)


def _top_k_top_p_renorm(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Keep each row's top-k tokens and its smallest top-p nucleus, renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    keep = ranks < top_ks.view(-1, 1).clamp_min(1)
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_ps.view(-1, 1)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
    return kept / kept.sum(-1, keepdim=True)


class DDTreeWorkerV2(DFlashWorkerV2):
    """DDTree speculative decoding on the DFlash v2 worker (page_size 1, no overlap)."""

    # Round graphs unless SGLANG_DDTREE_ROUND_GRAPHS is off (round_graphs_requested).
    ROUND_GRAPHS_DEFAULT = True
    # Set by init_cuda_graphs when they are captured, with the LM head they were captured
    # for (a round with another head runs eagerly).
    _round_graphs: Optional[DraftRoundGraphs] = None
    _round_graphs_head = None
    # Per round-graph batch size, captured with the round graphs: the accept (walk, commit,
    # KV move) unless SGLANG_DDTREE_ACCEPT_GRAPHS is off, the verify inputs (into one mask
    # buffer) unless SGLANG_DDTREE_VERIFY_GRAPHS is off; and the batch size of the round graph
    # this round replayed (None: it ran eagerly, and so do its verify inputs and accept).
    _accept_graphs: Optional[StepGraphs] = None
    _verify_graphs: Optional[StepGraphs] = None
    _verify_mask: Optional[torch.Tensor] = None
    _round_size: Optional[int] = None
    # The accept's KV move (``_kv_move``), chosen at its first use.
    _kv_mover = None
    # The decode round's host seconds in _draft_next_tokens and _make_verify_input. A class
    # default, so that it reads 0.0 before then (DFlashWorkerV2 forwards unknown attributes).
    _build_s = 0.0

    def __init__(self, server_args: ServerArgs, *args, **kwargs):
        # The DFlash v2 worker's own arguments (they differ between releases): the target
        # worker is always the last one.
        check_ddtree_algorithm(server_args, "DDTreeWorkerV2")
        refuse_budget_auto(server_args, "on SGLang 0.5.14 and later yet (0.5.13 only)")
        target_worker: TpModelWorker = kwargs.get("target_worker", args[-1] if args else None)
        refuse_hybrid_target(target_worker, server_args)
        super().__init__(server_args, *args, **kwargs)
        if (
            getattr(self, "_is_domino", False)
            or getattr(self, "selector", None) is not None
            or getattr(self, "lilicorr", None) is not None
        ):
            raise ValueError(
                "DDTREE drafts with the plain DFlash head; Domino, selector and LiLiCorr "
                "draft heads are not supported."
            )
        budget = get_spec().speculative_ddtree_budget
        self.budget = int(self.block_size - 1 if budget is None else budget)
        self.verify_width = self.budget + 1
        # The target's graphs, verify mask and KV reservation are sized by
        # speculative_num_draft_tokens; every draft-block slot must fit in it too.
        spec_width = int(get_spec().speculative_num_draft_tokens)
        if self.verify_width != spec_width or self.verify_width < int(self.block_size):
            raise ValueError(
                f"DDTREE needs speculative_num_draft_tokens == budget + 1 >= block size "
                f"(run the arguments through _handle_ddtree); got budget={self.budget}, "
                f"speculative_num_draft_tokens={spec_width}, block_size={self.block_size}."
            )
        # A rank-r node needs r better siblings in the tree, so K = budget is exact.
        self.topk = self.budget
        self._tree: Optional[ddtree_tree.DraftTree] = None
        self._verify_batch: Optional[ScheduleBatch] = None
        self._verify_input: Optional[DDTreeVerifyInputV2] = None
        self._accept_rows: Optional[torch.Tensor] = None
        self.round_timing = RoundTiming()
        if get_parallel().tp_rank == 0:
            logger.info(
                "DDTREE worker ready. budget=%d, top_k=%d, draft block_size=%d, "
                "verify width=%d",
                self.budget,
                self.topk,
                self.block_size,
                self.verify_width,
            )

    def forward_batch_generation(self, batch: ScheduleBatch, *args, **kwargs):
        """DFlash's round; a decode round's host time goes to ``round_timing``, a prefill's
        (an extend, or an extend on another DP rank) to the next decode round's gap. Idle
        rounds are not timed."""
        mode = batch.forward_mode
        if mode.is_idle():
            return super().forward_batch_generation(batch, *args, **kwargs)
        if mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
            return self.round_timing.prefill_round(
                super().forward_batch_generation, batch, *args, **kwargs
            )
        start = time.perf_counter()
        self._build_s = 0.0
        result = super().forward_batch_generation(batch, *args, **kwargs)
        self.round_timing.record(
            ddtree_budget_policy.batch_bucket(batch.batch_size()),
            self.verify_width,
            start=start,
            end=time.perf_counter(),
            build=self._build_s,
        )
        return result

    def ddtree_internal_state(self) -> dict:
        """What the scheduler's ``get_internal_state`` adds to ``/server_info``: the round
        timing (``ddtree_round_timing.py``) and, when they were captured, the round graphs'
        counters (``ddtree_round_graphs.py``). No budget policy: ``auto`` is refused here."""
        state = {"speculative_ddtree_round_timing": self.round_timing.snapshot()}
        if self._round_graphs is not None:
            state["speculative_ddtree_round_graphs"] = self._round_graphs.snapshot()
        if self._accept_graphs is not None:
            state["speculative_ddtree_accept_graphs"] = self._accept_graphs.snapshot()
        if self._verify_graphs is not None:
            state["speculative_ddtree_verify_graphs"] = self._verify_graphs.snapshot()
        if hasattr(self._kv_mover, "snapshot"):
            state["speculative_ddtree_kv_move_check"] = self._kv_mover.snapshot()
        return state

    def _drafter_block_size_arg(self) -> int:
        return ddtree_draft_block_size(get_spec().speculative_num_draft_tokens)

    def _verify_width(self) -> int:
        return self.verify_width

    def _verify_window(
        self,
        *,
        batch: ScheduleBatch,
        prefix_lens: torch.Tensor,
        kv_loc_plan,
        verify_out_cache_loc: torch.Tensor,
    ):
        """The verify's slots [prefix, prefix + verify_width): a window of its own when
        the tree is wider than the draft block (its first block_size slots are the
        draft block's, which keeps the draft block's plan for the draft KV writes)."""
        width = self.verify_width
        if width == int(self.block_size):
            return kv_loc_plan, verify_out_cache_loc
        bs = int(prefix_lens.shape[0])
        cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            start_offset=prefix_lens,
            end_offset=prefix_lens + width,
            batch_size=bs,
            draft_token_num=width,
            device=self.device,
        )
        translator = getattr(self.target_worker.model_runner, "kv_index_translator", None)
        if translator is None:  # before 0.5.22 the slots are the whole plan
            return kv_loc_plan, cache_loc
        plan = translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            seq_lens_cpu=kv_loc_plan.seq_lens_cpu,
            write_virtual=cache_loc,
            read_extent=width,
        )
        return plan, cache_loc

    def init_cuda_graphs(self):
        """The scheduler calls this after the target's graphs are captured: DFlash's draft
        graphs, then the round graphs (unless switched off) and the warm-up, in the draft
        head's own parallel placement where the release has one."""
        super().init_cuda_graphs()
        if _kv_move_checked():  # its counters allocated now, not inside a graph's capture
            self._kv_move()
        with self._draft_head_context():
            tp_group = get_parallel().tp_group
            # The round graphs first: every capture empties PyTorch's allocator caches, so
            # the warm-up runs last and serving starts with its blocks cached.
            if round_graphs_requested(self.ROUND_GRAPHS_DEFAULT):
                self._round_graphs = self._capture_round_graphs(tp_group)
            if self._round_graphs is not None:
                self._capture_step_graphs(tp_group)
            self._warm_eager_kernels(tp_group)

    def _draft_head_context(self):
        """The context the release runs the draft head in (``draft_tp_context`` of the
        worker's draft placement, 0.5.2x), or none."""
        enter = getattr(sys.modules[DFlashWorkerV2.__module__], "draft_tp_context", None)
        layout = getattr(self, "draft_parallel_layout", None)
        if enter is None or layout is None:
            return contextlib.nullcontext()
        return enter(layout)

    def _target_lm_head(self):
        """The target's LM head as the round passes it to the draft head (LoRA-unwrapped
        where the release does that), None without a vocab-parallel one."""
        lm_head = getattr(self.target_worker.model_runner.model, "lm_head", None)
        unwrap = getattr(sys.modules[DFlashWorkerV2.__module__], "unwrap_lora_layer", None)
        if lm_head is not None and unwrap is not None:
            lm_head = unwrap(lm_head)
        return lm_head if lm_head is not None and hasattr(lm_head, "weight") else None

    def _warm_eager_kernels(self, tp_group) -> list:
        """``warm_rounds`` at this server's budget for every batch size the target's CUDA
        graphs cover: the draft head, the tree and the verify inputs. Returns the
        (batch size, budget) pairs run."""
        runner = self.target_worker.model_runner
        lm_head = self._target_lm_head()
        if lm_head is None:
            return []
        device = runner.device

        def verify(tree, bs, budget):
            prefix_cpu = torch.full((bs,), 8, dtype=torch.int64)
            DDTreeVerifyInputV2.from_tree(
                tree,
                root_tokens=torch.zeros((bs,), dtype=torch.int64, device=device),
                prefix_lens=prefix_cpu.to(device),
                prefix_lens_cpu=prefix_cpu,
            )

        return warm_rounds(
            lm_head,
            tp_group,
            verify,
            sizes=graph_batch_sizes(runner),
            budgets=(self.budget,),
            n_pos=int(self.block_size) - 1,
            device=device,
            log=_rank0(tp_group),
        )

    def _capture_round_graphs(self, tp_group) -> Optional[DraftRoundGraphs]:
        """Unless ``SGLANG_DDTREE_ROUND_GRAPHS`` is off: ``capture_round_graphs`` at
        (K, budget) = (budget, budget) per CUDA-graph batch size; None (and a warning) where
        it does not apply: more than one rank, not CUDA, no vocab-parallel head, a failed
        capture."""
        lm_head = self._target_lm_head()
        graphs = capture_round_graphs(
            lm_head,
            tp_group,
            sizes=graph_batch_sizes(self.target_worker.model_runner),
            pairs=[(self.topk, self.budget)],
            n_pos=int(self.block_size) - 1,
            device=self.target_worker.model_runner.device,
            log=_rank0(tp_group),
        )
        self._round_graphs_head = lm_head if graphs is not None else None
        return graphs

    def _capture_step_graphs(self, tp_group) -> None:
        """The accept (unless ``SGLANG_DDTREE_ACCEPT_GRAPHS`` is off) and the verify inputs
        (unless ``SGLANG_DDTREE_VERIFY_GRAPHS`` is off) per round-graph batch size, on the round
        graphs' tree buffers (``ddtree_step_graphs_v2``); a step whose capture fails is left
        eager (with a warning)."""
        import torch

        d, device = self.verify_width, self.target_worker.model_runner.device
        if round_graphs_requested(True, ACCEPT_ENV, "accept graphs"):
            # inputs: the target's token per node, the window's KV slots, the prefix
            accept = StepGraphs(
                lambda tree, target, locs, prefix: self._accept(
                    tree, target, prefix, locs.reshape(-1)
                ),
                name="accept", row_widths=(d, d, 1), slots=2, device=device,
            )  # fmt: skip
            self._accept_graphs = self._captured(accept, tp_group, "walk + commit + KV move")
        if round_graphs_requested(True, VERIFY_ENV, "verify-input graphs"):
            most = max(self._round_graphs.sizes, default=0)
            self._verify_mask = torch.empty(
                (d * _mask_prefix_tokens(self.target_worker.model_runner, most) + most * d * d,),
                dtype=torch.bool,
                device=device,
            )
            # inputs: the root (the previous bonus token), the prefix
            verify = StepGraphs(
                self._verify_step, name="verify inputs", row_widths=(1, 1), slots=1,
                device=device,
            )  # fmt: skip
            self._verify_graphs = self._captured(verify, tp_group, "tokens, positions, mask")
            if self._verify_graphs is None:
                self._verify_mask = None

    def _captured(self, graphs: StepGraphs, tp_group, what: str) -> Optional[StepGraphs]:
        """``graphs`` captured on the round graphs' trees at this server's (K, budget)
        (``StepGraphs.capture``), logged; None (and a warning) when a capture fails."""
        import torch

        started = time.perf_counter()
        try:
            with torch.no_grad():
                graphs.capture(self._round_graphs, self.topk, self.budget)
        except (RoundGraphsError, RuntimeError) as exc:
            if _rank0(tp_group):
                logger.warning("DDTREE %s graphs not used: %s", graphs.name, exc)
            return None
        if _rank0(tp_group):
            logger.info(
                "DDTREE %s graphs: %d captured (%s; batch sizes %s) in %.1f s",
                graphs.name,
                graphs.snapshot()["graphs"],
                what,
                graphs.snapshot()["sizes"],
                time.perf_counter() - started,
            )
        return graphs

    def _verify_step(self, tree, roots, prefix):
        """The verify inputs as a graph builds them: the mask into the shared buffer."""
        inputs = ddtree_tree.verify_inputs(tree, roots, prefix, mask_out=self._verify_mask)
        return inputs.input_ids, inputs.positions

    def _maybe_build_draft_sampler(self):
        # The top-K head runs eagerly after the (graph-replayed) draft forward; the
        # in-graph greedy sampler would only compute an argmax DDTREE does not use.
        return None

    def _draft_next_tokens(
        self, *, draft_hidden: torch.Tensor, lm_head, bs: int
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        hidden = draft_hidden[:, 1:, :]
        self._round_size = None
        if self._round_graphs is not None and lm_head is self._round_graphs_head:
            _, _, self._tree = self._round_graphs(hidden, self.topk, self.budget)
            self._round_size = self._round_graphs.last_size
        else:
            logprobs, ids = draft_topk_logprobs(
                hidden, lm_head, self.topk, get_parallel().tp_group
            )
            self._tree = ddtree_tree.build_tree_from_topk(logprobs, ids, self.budget)
        # The caller keeps a [bs, block_size] token block (root + block_size - 1); only
        # its root is read back (_make_verify_input). The verify reads the whole tree.
        tokens = self._tree.tokens[:, : int(self.block_size) - 1]
        self._build_s += time.perf_counter() - t0
        return tokens

    def _make_verify_input(
        self,
        *,
        batch: ScheduleBatch,
        draft_tokens: torch.Tensor,
        positions: torch.Tensor,
        prefix_lens: torch.Tensor,
        kv_loc_plan,
        verify_out_cache_loc: torch.Tensor,
    ) -> DDTreeVerifyInputV2:
        if self._tree is None:
            raise RuntimeError("DDTREE verify input requested before a tree was built.")
        t0 = time.perf_counter()
        self._verify_batch = batch
        # Without a synchronisation: the batch's host lengths are the committed prefix
        # (prepare_for_decode seeds them; no overlap scheduler under DDTREE).
        self._verify_input = self._replayed_verify_input(
            draft_tokens[:, 0], prefix_lens, batch.seq_lens_cpu, kv_loc_plan
        ) or DDTreeVerifyInputV2.from_tree(
            self._tree,
            root_tokens=draft_tokens[:, 0],
            prefix_lens=prefix_lens,
            prefix_lens_cpu=batch.seq_lens_cpu,
            kv_loc_plan=kv_loc_plan,
        )
        self._build_s += time.perf_counter() - t0
        return self._verify_input

    def _replayed_verify_input(
        self, roots, prefix_lens, prefix_lens_cpu, kv_loc_plan
    ) -> Optional[DDTreeVerifyInputV2]:
        """The verify input from the verify graph of the round graph's size, None where
        there is none (no graphs, an eager round, no host lengths) or the mask would not
        fit the shared buffer (the rows past the batch write an empty prefix's mask after
        the real one)."""
        graphs, size = self._verify_graphs, self._round_size
        if graphs is None:
            return None
        if size is not None and prefix_lens_cpu is not None:
            n, bs = self.verify_width, int(prefix_lens_cpu.shape[0])
            numel = n * int(prefix_lens_cpu.sum()) + bs * n * n
            if numel + (size - bs) * n * n <= self._verify_mask.numel():
                out = graphs(size, (roots, prefix_lens))  # None: counted eager there
                if out is None:
                    return None
                return DDTreeVerifyInputV2.from_inputs(
                    *out, self._verify_mask[:numel], n, kv_loc_plan=kv_loc_plan
                )
        graphs.eager += 1
        return None

    def _target_tokens_per_node(
        self, next_token_logits: torch.Tensor, sampling_info, bs: int
    ) -> torch.Tensor:
        """One target sample per node (temperature > 0), identical on every TP rank."""
        d = self.verify_width
        temperatures = torch.repeat_interleave(sampling_info.temperatures, d, dim=0)
        probs = torch.softmax(next_token_logits.float() / temperatures, dim=-1)
        probs = _top_k_top_p_renorm(
            probs,
            torch.repeat_interleave(sampling_info.top_ks, d, dim=0),
            torch.repeat_interleave(sampling_info.top_ps, d, dim=0),
        )
        samples = torch.multinomial(probs, 1).view(bs, d)
        tp_group = get_parallel().tp_group
        if int(tp_group.world_size) > 1:
            tp_group.broadcast(samples, src=0)
        return samples

    def _accept_block(
        self,
        *,
        candidates: torch.Tensor,
        next_token_logits: torch.Tensor,
        sampling_info,
        draft_input,
        prefix_lens: torch.Tensor,
        bs: int,
        target_predict: Optional[torch.Tensor] = None,
    ):
        """Walk each tree with the target's token per node (its argmax, or one sample per
        node at temperature > 0), move the accepted path's KV to the front of its verify
        window and return what DFlash's accept returns (``_accept``): replayed from the
        accept graph of the round graph's batch size where there is one
        (``ddtree_step_graphs_v2``), else three launches from Python."""
        tree, batch = self._tree, self._verify_batch
        # d: tree slots per request in the verify.
        d = self.verify_width
        if target_predict is None:
            if sampling_info is None or sampling_info.is_all_greedy:
                target_predict = torch.argmax(next_token_logits, dim=-1)
            else:
                target_predict = self._target_tokens_per_node(
                    next_token_logits, sampling_info, bs
                )
        target = target_predict.view(bs, d).to(torch.int64)
        # The KV moves' targets lead each request's verify window (batch.out_cache_loc),
        # as in SGLang's own move_accept_tokens_to_target_kvcache.
        locs = batch.out_cache_loc
        graphs, out = self._accept_graphs, None
        if graphs is not None and locs.numel() == bs * d:
            out = graphs(self._round_size, (target, locs.reshape(bs, d), prefix_lens))
        if out is None:
            out = self._accept(tree, target, prefix_lens, locs)
        num_correct, commit_lens, bonus, out_tokens, new_seq_lens, rows = out
        self._accept_rows = rows.reshape(-1)
        return num_correct, commit_lens, bonus, out_tokens, new_seq_lens

    def _accept(self, tree, target, prefix_lens, locs) -> tuple:
        """``ddtree_commit_v2.accept_round`` into the target's KV pool: the walk
        (``ddtree_tree``: path, length, bonus and the rows that compact the path), the commit
        (tokens, lengths and the KV moves) and the pool's move: three launches on a GPU,
        captured as they are by the accept graphs. The emitted tokens are
        laid out with stride block_size as the scheduler reads them (the walk's path is
        block_size wide: the tree is at most block_size - 1 deep); the hidden rows for the
        draft KV ([bs, block_size] rows of the flat [bs * d] verify) are the accepted path
        first, the window's own rows after it (never committed)."""
        return accept_round(tree, target, prefix_lens, locs, self._kv_move())

    def _kv_move(self):
        """The accept's KV move: ``ddtree_commit_v2.window_kv_move`` (the accepted rows only,
        one launch) where the pool keeps plain slot rows, else the pool's ``move_kv_cache``
        (every window row), which ``SGLANG_DDTREE_WINDOW_KV_MOVE=0`` asks for everywhere; with
        it ``check``, both every round (``ddtree_commit_v2.checked_kv_move``: the pool's result
        kept, the differences counted in ``/server_info``); chosen once, logged."""
        if self._kv_mover is None:
            pool = self.target_worker.model_runner.token_to_kv_pool_allocator.get_kvcache()
            kind = type(pool).__name__
            if _kv_move_checked():
                fast = window_kv_move(pool)
                mover = fast and checked_kv_move(pool, fast, pool_move(pool))
                how = ("the pool's own, checked every round against the accepted rows' move"
                       if mover is not None
                       else f"the pool's own ({kind} keeps other rows: no check)")  # fmt: skip
            elif round_graphs_requested(True, WINDOW_MOVE_ENV, "window KV move"):
                mover = window_kv_move(pool)
                how = ("accepted rows only" if mover is not None
                       else f"the pool's own ({kind} keeps other rows)")  # fmt: skip
            else:
                mover, how = None, f"the pool's own ({WINDOW_MOVE_ENV} is off)"
            logger.info("DDTREE KV move: %s", how)
            self._kv_mover = mover or pool_move(pool)
        return self._kv_mover

    def _committed_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        rows, self._accept_rows = self._accept_rows, None
        self._tree, self._round_size = None, None
        self._verify_batch = None
        self._verify_input = None
        if rows is None:
            return hidden
        return hidden.reshape(-1, hidden.shape[-1])[rows]


def _kv_move_checked() -> bool:
    """``SGLANG_DDTREE_WINDOW_KV_MOVE=check``: both KV moves every round, compared."""
    return os.environ.get(WINDOW_MOVE_ENV, "").strip().lower() == WINDOW_MOVE_CHECK


def _mask_prefix_tokens(runner, most: int) -> int:
    """The prefix tokens the verify graphs' shared mask buffer makes room for: as many as the
    KV pool holds, and no more than ``most`` (the largest round-graph size) requests of the
    model's context length can have (a small model's pool holds tens of millions of tokens;
    a mask row per verify slot over all of them would take gigabytes). A round whose
    prefixes add up past it (cached tokens shared between requests) builds its mask eagerly."""
    pool = int(getattr(runner, "max_total_num_tokens", 0) or 0)
    context = getattr(getattr(runner, "model_config", None), "context_len", None)
    return pool if not context else min(pool, most * int(context))


def _rank0(tp_group) -> bool:
    """Whether this is the group's first rank (the one that logs); one rank without a group."""
    return int(getattr(tp_group, "rank_in_group", 0) or 0) == 0
