"""DDTREE worker for spec v1: the DFlash worker with a draft tree instead of a chain.

Two widths: the drafter runs its own block (``block_size``, from
``speculative_dflash_block_size``) and the target verifies the root plus ``budget`` tree
nodes (``speculative_num_draft_tokens = budget + 1``).

Everything but two steps is DFlash's: prefill, the draft block forward, draft KV
materialisation and the scheduler protocol are inherited. DDTREE replaces the draft argmax
with a per-position top-K log-probability head and builds a best-first tree from it
(``ddtree_tree.py``); ``DDTreeVerifyInput`` verifies the tree and commits the accepted path.

``--speculative-ddtree-budget auto``: the budget is chosen every round for the running
batch by ``ddtree_budget_policy.py`` (a verbatim copy of ``ddtree_cli/budget_policy.py``,
the embedded engine's policy). ``_handle_ddtree`` sizes everything SGLang fixes at start-up
for the largest candidate (``speculative_num_draft_tokens = max budget + 1``: the scheduler's
reservation, the attention buffers, the widest verify graphs); this worker captures one
more set of target-verify CUDA graphs per smaller candidate width, sharing the widest's
attention buffers, and before each verify selects the runner and the triton backend's
verify width for the round's budget. The draft head's top-K is taken at the round's budget
(at the largest on probe rounds, which read every candidate's tree value), exact for its
tree. Every round's host time, draft to commit, goes to the policy as the round ends
(``observe_time``); the trees' statistics (each candidate's value and accepted count) are
read on probe rounds and one in ``OBSERVE_EVERY`` of the others only: computed on the
device, copied to pinned memory without a synchronisation and read a round later, when a
verify's host synchronisation has passed them (``observe_stats``).

Every DDTREE server (fixed budget or auto) times its rounds on the host
(``ddtree_round_timing.py``, in ``/server_info``: each round's draft, build, verify and,
under auto, the policy's work) and, at start-up, runs the round's eager
part once per budget and CUDA-graph batch size so that its Triton kernels compile before the
first request. By default (one rank, CUDA; ``SGLANG_DDTREE_ROUND_GRAPHS=0`` turns it off) it
first captures the draft head and the tree build in CUDA graphs per batch size, K and budget
(``ddtree_round_graphs.py``) and replays them instead of launching both from Python; on the
H200 that halved the build's host time, and two maps at concurrency 1-32 with graph servers
had budget 15 and auto at or above DFLASH everywhere (docs/performance.md). The capture
comes before the warm-up because each capture empties PyTorch's allocator caches: on the
H200 the graph servers, which captured after the warm-up, had one
forward round of 240-350 ms per batch size and the eager server none (the new order is not
yet run on a GPU).

Run on an H200 (0.5.13, the 8B-cost pair; docs/performance.md): lossless, the budget follows
the batch. With one observed round in four, K = the round's budget and the start-up warm-up,
auto's round still took 0.5-1.0 ms more than the fixed budget it chose at the same width,
0.4 ms of it the policy's host work (an observed round's statistics and events about 1.2 ms,
the round after it reading them); hence one observed round in sixteen: the next runs
measured the policy's host work at 0.04 ms a round p50, 0.13-0.15 ms mean. Since round times
are host times, every round is timed and only the statistics are read on some rounds
(probes, and one in ``OBSERVE_EVERY`` of the others): in the sixteenth run the statistics
were read on 6 % of rounds (13 % before), the policy's host work 0.14 ms a round mean as
before (timing every round costs about what the fewer reads saved), 0.065 p50.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from sglang.srt.distributed import get_tp_group
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative import ddtree_budget_policy, ddtree_tree
from sglang.srt.speculative.ddtree_info import DDTreeVerifyInput
from sglang.srt.speculative.ddtree_round_graphs import (
    DraftRoundGraphs,
    capture_round_graphs,
    graph_batch_sizes,
    round_graphs_requested,
    warm_rounds,
)
from sglang.srt.speculative.ddtree_round_timing import RoundTiming
from sglang.srt.speculative.ddtree_utils import (
    check_ddtree_algorithm,
    draft_topk_logprobs,
    refuse_hybrid_target,
)
from sglang.srt.speculative.dflash_worker import DFlashWorker
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

logger = logging.getLogger(__name__)


def check_ddtree_worker_args(server_args: ServerArgs) -> SpeculativeAlgorithm:
    """What a DDTreeWorker needs from its arguments, checked before any model loads."""
    algorithm = check_ddtree_algorithm(server_args, "DDTreeWorker")
    # _handle_ddtree keeps two widths apart: the drafter's block and the target's verify
    # width (budget + 1), which sizes the target's graphs, attention metadata and the
    # scheduler's reservations.
    block_size = server_args.speculative_dflash_block_size
    budget = server_args.speculative_ddtree_budget
    if budget == "auto":  # the verify width is the largest candidate's
        budget = server_args.speculative_ddtree_max_budget
    width = server_args.speculative_num_draft_tokens
    if block_size is None or budget is None or width is None:
        raise ValueError(
            "DDTREE needs the drafter's block size, the budget and the verify width "
            "resolved by _handle_ddtree; got speculative_dflash_block_size="
            f"{block_size}, speculative_ddtree_budget={budget}, "
            f"speculative_num_draft_tokens={width}."
        )
    if int(budget) < 1 or int(width) != int(budget) + 1:
        raise ValueError(
            f"DDTREE verifies budget + 1 tokens per request: got budget={budget} and "
            f"speculative_num_draft_tokens={width}."
        )
    budget_policy_config(server_args)
    return algorithm


# The budget policy's settings under budget auto, ``name=value`` pairs separated by commas
# (``PolicyConfig.from_text``): for trying a setting side by side with the default on one
# machine (``benchmarks/sglang_h200/crossover.py``'s switch ``h``); unset, the defaults.
BUDGET_POLICY_ENV = "SGLANG_DDTREE_BUDGET_POLICY"


def budget_policy_config(server_args: ServerArgs):
    """The ``PolicyConfig`` of a budget-auto server from ``SGLANG_DDTREE_BUDGET_POLICY``
    (None for a fixed budget); ValueError in one line for a bad setting, or for the
    variable set on a server with a fixed budget."""
    text = os.environ.get(BUDGET_POLICY_ENV, "").strip()
    if server_args.speculative_ddtree_budget != "auto":
        if text:
            raise ValueError(
                f"{BUDGET_POLICY_ENV} applies to --speculative-ddtree-budget auto only"
            )
        return None
    try:
        return ddtree_budget_policy.PolicyConfig.from_text(text)
    except ValueError as exc:
        raise ValueError(f"{BUDGET_POLICY_ENV}: {exc}") from None


class DDTreeWorker(DFlashWorker):
    """DDTree speculative decoding worker (spec-v1, tp>=1, pp=1, page_size 1)."""

    # Round graphs unless SGLANG_DDTREE_ROUND_GRAPHS is off (round_graphs_requested).
    ROUND_GRAPHS_DEFAULT = True
    # Set by __init__ when they are captured. A class default, so that it reads None before
    # then (DFlashWorker forwards unknown attributes).
    _round_graphs: Optional[DraftRoundGraphs] = None

    def __init__(
        self,
        server_args: ServerArgs,
        gpu_id: int,
        tp_rank: int,
        dp_rank: Optional[int],
        moe_ep_rank: int,
        attn_cp_rank: int,
        moe_dp_rank: int,
        nccl_port: int,
        target_worker: TpModelWorker,
    ):
        check_ddtree_worker_args(server_args)
        refuse_hybrid_target(target_worker, server_args)
        super().__init__(
            server_args,
            gpu_id,
            tp_rank,
            dp_rank,
            moe_ep_rank,
            attn_cp_rank,
            moe_dp_rank,
            nccl_port,
            target_worker,
        )
        self.policy: Optional[ddtree_budget_policy.BudgetPolicy] = None
        if server_args.speculative_ddtree_budget == "auto":
            self.policy = ddtree_budget_policy.BudgetPolicy(
                ddtree_budget_policy.candidate_budgets(
                    self.block_size, server_args.speculative_ddtree_max_budget
                ),
                budget_policy_config(server_args),
            )
            self.budget = self.policy.max_budget  # the widest; each round picks its own
        else:
            self.budget = int(server_args.speculative_ddtree_budget)
        self.verify_width = self.budget + 1
        # Ranks beyond the budget can never enter the tree (a rank-r node needs r
        # better siblings), so K = the round's budget keeps its tree exact; a probe
        # round (auto) takes K = the largest candidate, exact for every smaller one. The
        # tree is at most block_size - 1 deep (the drafted positions), whatever the budget.
        self.round_budget = self.budget  # the latest round's (under auto, its choice)
        self._round: Optional[_Round] = None
        self._pending: Optional[_Round] = None
        self.round_timing = RoundTiming()
        self._build_s = 0.0  # the latest round's _build_verify_input, host seconds
        self._build_at: Optional[float] = None  # ... and when it started (perf_counter)
        self._dflash_at = 0.0  # when DFlash's round started (after auto's plan)
        if self.policy is not None:
            self._init_budget_auto()
        # The round graphs first: every capture empties PyTorch's allocator caches
        # (torch.cuda.graph does), so the warm-up runs last and serving starts, as in a
        # server without them, with the warm-up's blocks cached.
        if round_graphs_requested(self.ROUND_GRAPHS_DEFAULT):
            self._round_graphs = self._capture_round_graphs(get_tp_group())
        self._warm_eager_kernels(get_tp_group())
        if self.tp_rank == 0:
            logger.info(
                "DDTREE worker ready. budget=%s, top_k<=%d, draft block_size=%d, "
                "verify width=%d%s",
                server_args.speculative_ddtree_budget,
                self.budget,
                self.block_size,
                self.verify_width,
                f", candidates={list(self.policy.budgets)}" if self.policy else "",
            )

    # ---- budget auto -------------------------------------------------------------

    def _init_budget_auto(self) -> None:
        """Per candidate width: a target-verify graph runner (the widest is SGLang's own),
        the candidates its tree speaks for, and pinned host buffers for its statistics."""
        runner = self.target_worker.model_runner
        backend = runner.attn_backend
        if not hasattr(backend, "num_draft_tokens") or not hasattr(
            backend, "init_cuda_graph_state"
        ):
            raise ValueError(
                "--speculative-ddtree-budget auto needs the triton attention backend on "
                f"the target, got {type(backend).__name__}."
            )
        device = runner.device
        budgets = self.policy.budgets
        self._candidates = candidate_tensors(budgets, device)
        # Two sets, alternating by round: a round's copies land while the previous round's
        # are read.
        self._host_stats = [
            {b: torch.empty((2, len(self._candidates[b])), pin_memory=True) for b in budgets}
            for _ in range(2)
        ]
        self._host_probe = [torch.empty((len(budgets),), pin_memory=True) for _ in range(2)]
        self._parity = 0
        self._planned = 0
        self._graph_runners: Dict[int, object] = {}
        widest = runner.graph_runner
        if widest is None:  # --disable-cuda-graph: every verify runs eagerly
            return
        self._graph_runners[self.verify_width] = widest
        from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

        # A runner's constructor re-allocates the backend's CUDA-graph buffers, which the
        # widest runner's graphs read: keep those (sized for the widest verify, so large
        # enough for any narrower one) while the narrower runners capture.
        backend.init_cuda_graph_state = lambda *args, **kwargs: None
        try:
            for budget in budgets[:-1]:
                width = budget + 1
                backend.num_draft_tokens = width
                self._graph_runners[width] = CudaGraphRunner(
                    runner, speculative_num_draft_tokens=width
                )
        finally:
            del backend.init_cuda_graph_state
            backend.num_draft_tokens = self.verify_width
        runner.graph_runner = widest

    def _target_lm_head(self):
        """The target's vocab-parallel LM head (the draft head's), None without one."""
        lm_head = getattr(self.target_worker.model_runner.model, "lm_head", None)
        return lm_head if lm_head is not None and hasattr(lm_head, "weight") else None

    def _round_budgets(self) -> tuple:
        """The budgets this server's rounds verify at: its own, or auto's candidates."""
        return self.policy.budgets if self.policy is not None else (self.budget,)

    def _warm_eager_kernels(self, tp_group) -> list:
        """``warm_rounds``: the round's eager part (draft head, tree, verify inputs and,
        under auto, the tree statistics) once per budget this server verifies at and per
        batch size its CUDA graphs cover, on dummy inputs, so that the Triton kernels
        compile (or load from the cache) and cuBLAS picks its head kernels at start-up
        rather than in the first rounds at a new budget or batch size, where a request
        would wait for them. The verify and draft graphs themselves were run when they were
        captured. Every rank runs the same calls (the head's tensor-parallel merge is
        collective). Returns the (batch size, budget) pairs run."""
        runner = self.target_worker.model_runner
        lm_head = self._target_lm_head()
        if lm_head is None:
            return []
        device = runner.device

        def verify_and_stats(tree, bs, budget):
            prefix_cpu = torch.full((bs,), 8, dtype=torch.int64)
            DDTreeVerifyInput.from_tree(
                tree,
                root_tokens=torch.zeros((bs,), dtype=torch.int64, device=device),
                prefix_lens=prefix_cpu.to(device),
                prefix_lens_cpu=prefix_cpu,
            )
            if self.policy is not None:
                accept = torch.full((bs, budget + 1), -1, dtype=torch.int32, device=device)
                _tree_stats(tree, accept, self._candidates[budget])

        return warm_rounds(
            lm_head,
            tp_group,
            verify_and_stats,
            sizes=graph_batch_sizes(runner),
            budgets=self._round_budgets(),
            n_pos=self.block_size - 1,
            device=device,
            log=self.tp_rank == 0,
        )

    def _capture_round_graphs(self, tp_group) -> Optional[DraftRoundGraphs]:
        """Unless ``SGLANG_DDTREE_ROUND_GRAPHS`` is off: ``capture_round_graphs`` per
        CUDA-graph batch size and (K, budget) the rounds use: (budget, budget) for every
        budget, and under auto (largest, budget) for the probe rounds. None (and a warning)
        where it does not apply: more than one rank, not CUDA, no vocab-parallel head, a
        failed capture."""
        pairs = []
        for budget in self._round_budgets():
            pairs.append((budget, budget))
            if self.policy is not None and budget < self.budget:
                pairs.append((self.budget, budget))  # probe rounds
        return capture_round_graphs(
            self._target_lm_head(),
            tp_group,
            sizes=graph_batch_sizes(self.target_worker.model_runner),
            pairs=pairs,
            n_pos=self.block_size - 1,
            device=self.target_worker.model_runner.device,
            log=self.tp_rank == 0,
        )

    # Under auto: rounds per round whose tree statistics are read, besides the probes
    # (every ``probe_every`` rounds). Reading them costs host time (on the H200 about
    # 0.8 ms per such round, the policy's mean 0.13-0.15 ms a round with one in 16 and
    # every exploration and re-timing round read); a round's time costs a few perf_counter
    # calls and the policy's ``observe_time``.
    OBSERVE_EVERY = 32

    def _use_width(self, width: int) -> None:
        """The target's verify width for this round: its graph runner and the triton
        backend's per-request query count (qo/mask indptr and the verify kernel's grid)."""
        runner = self.target_worker.model_runner
        runner.attn_backend.num_draft_tokens = width
        if self._graph_runners:
            runner.graph_runner = self._graph_runners[width]

    def forward_batch_generation(self, batch: ScheduleBatch, **kwargs):
        if batch.forward_mode.is_idle():
            return super().forward_batch_generation(batch, **kwargs)
        if batch.forward_mode.is_extend():  # a prefill: part of the next round's gap
            return self.round_timing.prefill_round(
                super().forward_batch_generation, batch, **kwargs
            )
        start = time.perf_counter()
        self._build_s, self._build_at, self._dflash_at = 0.0, None, start
        bs = batch.batch_size()
        if self.policy is None:
            result, policy_s = super().forward_batch_generation(batch, **kwargs), 0.0
        else:
            result, policy_s = self._forward_auto(batch, bs, **kwargs)
        end = time.perf_counter()
        draft = verify = None
        if self._build_at is not None:  # DFlash's round: draft, build (ours), verify
            draft = self._build_at - self._dflash_at
            verify = end - start - policy_s - draft - self._build_s
        self.round_timing.record(
            ddtree_budget_policy.batch_bucket(bs),
            self.round_budget + 1,
            start=start,
            end=end,
            build=self._build_s,
            policy=policy_s,
            draft=draft,
            verify=verify,
        )
        return result

    def _forward_auto(self, batch: ScheduleBatch, bs: int, **kwargs):
        """A decode round under budget auto: (the result, host seconds of the policy's own
        work: plan, statistics, observation)."""
        t0 = time.perf_counter()
        plan = self.policy.plan(bs)
        self._planned += 1
        # Statistics on probe rounds (every candidate's value) and one in OBSERVE_EVERY of
        # the others (the calibration's accepted counts); every round is timed.
        observed = plan.probe or self._planned % self.OBSERVE_EVERY == 0
        if observed:
            self._parity ^= 1
        current = _Round(batch=bs, plan=plan, parity=self._parity, observed=observed)
        self._round = current
        t1 = self._dflash_at = time.perf_counter()
        policy_s = t1 - t0
        try:
            result = super().forward_batch_generation(batch, **kwargs)
        finally:
            self._round = None
        t0 = time.perf_counter()
        # The round's cost is its host time, draft to commit: the scheduler's loop waits
        # for it (the verify synchronises), and it does not depend on what ran before.
        # CUDA events did: a round after an observed one (its statistics' launches, the
        # policy's bookkeeping, ~0.9 ms of host time) found the device idle and timed its
        # own asynchronous tail as well, one after an unobserved round did not, so every
        # re-timed or explored width (all after observed rounds) looked 0.5-1.4 ms dearer
        # than the budget in use (fourteenth GPU run, docs/validation.md). A probe below
        # the largest budget built the largest tree too: the policy takes it as untimed.
        if current.verify_input is not None:
            self.policy.observe_time(bs, plan.budget, t0 - t1, wide=current.probe is not None)
        # This round's verify synchronised the host with the device, so the last observed
        # round's statistics are on the host: read them without a new sync (its ``ready``
        # event, recorded after their copy, guards against a verify that stops syncing).
        self._observe(self._pending)
        self._pending = None
        if observed and current.verify_input is not None:
            stats = _tree_stats(
                current.tree,
                current.verify_input.accept_index,
                self._candidates[current.plan.budget],
            )
            current.stats = self._host_stats[current.parity][current.plan.budget]
            current.stats.copy_(stats, non_blocking=True)
            current.ready.record()
            self._pending = current
        return result, policy_s + time.perf_counter() - t0

    def _observe(self, done: Optional["_Round"]) -> None:
        if done is None or not done.ready.query():
            return
        values, accepted = done.stats.tolist()
        probe = done.probe.tolist() if done.probe is not None else None
        self.policy.observe_stats(
            done.batch, done.plan.budget, **self.policy.prefix_stats(values, accepted, probe)
        )

    def ddtree_internal_state(self) -> dict:
        """What the scheduler's ``get_internal_state`` adds to ``/server_info``: the round
        timing (``ddtree_round_timing.py``) and, under budget auto, the policy's state
        (budget per batch bucket, round times, calibration, recent changes)."""
        state = {"speculative_ddtree_round_timing": self.round_timing.snapshot()}
        if self._round_graphs is not None:
            state["speculative_ddtree_round_graphs"] = self._round_graphs.snapshot()
        if self.policy is not None:
            state["speculative_ddtree_budget_policy"] = self.policy.snapshot()
        return state

    @property
    def speculative_num_draft_tokens(self) -> int:
        """The latest round's verify width, budget + 1: SGLang's metrics reporter reads it
        as the active tier (the ``sglang:spec_num_draft_tokens`` gauge)."""
        return self.round_budget + 1

    def _drafter_block_size_arg(self, server_args: ServerArgs) -> Optional[int]:
        # _handle_ddtree keeps the drafter's block here; speculative_num_draft_tokens is
        # the target's verify width (budget + 1).
        return server_args.speculative_dflash_block_size

    def _build_verify_input(
        self,
        *,
        batch: ScheduleBatch,
        draft_hidden: torch.Tensor,
        lm_head,
        block_ids: torch.Tensor,
        positions_2d: torch.Tensor,
    ) -> DDTreeVerifyInput:
        t0 = self._build_at = time.perf_counter()
        current = self._round
        budget = self.budget if current is None else current.plan.budget
        probe = current is not None and current.plan.probe and budget < self.budget
        self.round_budget = budget
        head_k = self.budget if probe else budget
        if self._round_graphs is not None:
            logprobs, ids, tree = self._round_graphs(draft_hidden[:, 1:, :], head_k, budget)
        else:
            logprobs, ids = draft_topk_logprobs(
                draft_hidden[:, 1:, :], lm_head, head_k, get_tp_group()
            )
            tree = ddtree_tree.build_tree_from_topk(logprobs, ids, budget)
        verify_input = DDTreeVerifyInput.from_tree(
            tree,
            root_tokens=block_ids[:, 0],
            prefix_lens=batch.seq_lens,
            prefix_lens_cpu=batch.seq_lens_cpu,
        )
        if current is not None:
            if probe:
                # Every candidate's value from one tree at the largest budget (the
                # best-first tree is a prefix order); the policy leaves the round untimed.
                widest = ddtree_tree.build_tree_from_topk(logprobs, ids, self.budget)
                values = _tree_stats(widest, None, self._candidates[self.budget])[0]
                current.probe = self._host_probe[current.parity]
                current.probe.copy_(values, non_blocking=True)
            current.tree, current.verify_input = tree, verify_input
            self._use_width(budget + 1)
        self._build_s = time.perf_counter() - t0
        return verify_input

    def _update_target_mamba_state_after_verify(
        self,
        *,
        batch: ScheduleBatch,
        seq_lens_pre_verify: torch.Tensor,
        commit_lens: torch.Tensor,
    ) -> None:
        # Only reached with --speculative-ddtree-allow-hybrid. Commit the state of the
        # last accepted node (its slot, not commit_len - 1 as for a chain); the states
        # themselves were scanned in slot order, which is why hybrids are refused.
        verify_input = batch.spec_info
        if not isinstance(verify_input, DDTreeVerifyInput):
            return super()._update_target_mamba_state_after_verify(
                batch=batch,
                seq_lens_pre_verify=seq_lens_pre_verify,
                commit_lens=commit_lens,
            )
        attn_backend = self.target_worker.model_runner.attn_backend
        if not hasattr(attn_backend, "update_mamba_state_after_mtp_verify"):
            return
        attn_backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=verify_input.last_accepted_slot,
            mamba_track_indices=batch.mamba_track_indices,
            mamba_steps_to_track=None,
            model=self.target_worker.model_runner.model,
        )


@dataclass
class _Round:
    """One decode round under budget auto: timed as it ends, its statistics (when read)
    observed a round later."""

    batch: int
    plan: "ddtree_budget_policy.Plan"
    parity: int  # which of the two sets of pinned host buffers it writes
    observed: bool = True  # its statistics read (else: only run at plan.budget)
    ready: torch.cuda.Event = None  # recorded after its statistics' copy to the host
    tree: Optional[ddtree_tree.DraftTree] = None
    verify_input: Optional[DDTreeVerifyInput] = None
    stats: Optional[torch.Tensor] = None  # pinned [2, candidates up to the round's]
    probe: Optional[torch.Tensor] = None  # pinned [candidates]: the largest tree's values

    def __post_init__(self):
        if self.observed:
            self.ready = torch.cuda.Event()


def candidate_tensors(budgets, device) -> Dict[int, torch.Tensor]:
    """Per candidate budget, the candidates its tree speaks for (those up to it), as the
    int64 tensor ``_tree_stats`` takes."""
    return {b: torch.tensor([c for c in budgets if c <= b], device=device) for b in budgets}


def _tree_stats(
    tree: ddtree_tree.DraftTree,
    accept_index: Optional[torch.Tensor],
    budgets: torch.Tensor,
) -> torch.Tensor:
    """``ddtree_tree.prefix_stats`` of the tree and SGLang's tree-verify output
    (``accept_index``: flat rows ``i * D + slot`` of each request's accepted path, root
    first, -1 after; a slot is a node id): per candidate budget in ``budgets``, summed over
    the batch, the value of its tree and the drafted tokens it would have accepted;
    ``[2, candidates]``, the second row zero without ``accept_index``."""
    path = None
    if accept_index is not None:
        bs, d = accept_index.shape
        rows = accept_index[:, 1:].long()
        offsets = torch.arange(bs, device=rows.device).unsqueeze(1) * d
        path = torch.where(rows >= 0, rows - offsets, torch.full_like(rows, -1))
    return ddtree_tree.prefix_stats(tree.scores, path, budgets)
