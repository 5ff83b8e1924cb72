"""DDTREE worker for spec v1: the DFlash worker with a draft tree instead of a chain.

Two widths: the drafter runs its own block (``block_size``, from
``speculative_dflash_block_size``) and the target verifies the root plus ``budget`` tree
nodes (``speculative_num_draft_tokens = budget + 1``).

Everything but two steps is DFlash's: prefill, the draft block forward, draft KV
materialisation and the scheduler protocol are inherited. DDTREE replaces the draft argmax
with a per-position top-K log-probability head and builds a best-first tree from it
(``ddtree_tree.py``); ``DDTreeVerifyInput`` verifies the tree and commits the accepted path.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.distributed import get_tp_group
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative import ddtree_tree
from sglang.srt.speculative.ddtree_info import DDTreeVerifyInput
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
    return algorithm


class DDTreeWorker(DFlashWorker):
    """DDTree speculative decoding worker (spec-v1, tp>=1, pp=1, page_size 1)."""

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
        self.budget = int(server_args.speculative_ddtree_budget)
        self.verify_width = self.budget + 1
        # Ranks beyond the budget can never enter the tree (a rank-r node needs r
        # better siblings), so K = budget keeps the tree exact. The tree is at most
        # block_size - 1 deep (the drafted positions), whatever the budget.
        self.topk = self.budget
        if self.tp_rank == 0:
            logger.info(
                "DDTREE worker ready. budget=%d, top_k=%d, draft block_size=%d, "
                "verify width=%d",
                self.budget,
                self.topk,
                self.block_size,
                self.verify_width,
            )

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
        logprobs, ids = draft_topk_logprobs(
            draft_hidden[:, 1:, :], lm_head, self.topk, get_tp_group()
        )
        tree = ddtree_tree.build_tree_from_topk(logprobs, ids, self.budget)
        return DDTreeVerifyInput.from_tree(
            tree,
            root_tokens=block_ids[:, 0],
            prefix_lens=batch.seq_lens,
            prefix_lens_cpu=batch.seq_lens_cpu,
        )

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
