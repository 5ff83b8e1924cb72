"""DDTREE verify input for the spec-v1 DFlash worker.

The verify window (``D = budget + 1`` slots per request, the target's
``speculative_num_draft_tokens``; independent of the drafter's block size) holds a draft
tree instead of a chain: slot 0 is the root (the previous bonus token), slots 1.. the tree
nodes in an order where every parent precedes its children. The target runs one
TARGET_VERIFY pass under a FULL_MASK tree mask; SGLang's tree verify kernels
(``verify_tree_greedy`` / ``tree_speculative_sampling_target_only``) walk the tree with the
``retrieve_*`` arrays. The algorithm itself lives in ``ddtree_tree.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import apply_custom_logit_processor
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.server_args import get_global_server_args
from sglang.srt.speculative import ddtree_tree
from sglang.srt.speculative.ddtree_utils import tree_verify_inputs
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_utils import (
    TREE_SPEC_KERNEL_AVAILABLE,
    assign_req_to_token_pool_func,
)

logger = logging.getLogger(__name__)


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    # int64 [bs, D]: flat row of each node, its first child, its next sibling (-1: none).
    retrieve_index: Optional[torch.Tensor] = None
    retrieve_next_token: Optional[torch.Tensor] = None
    retrieve_next_sibling: Optional[torch.Tensor] = None
    # int64 [bs]: slot of the last accepted node, set by verify() (for the Mamba commit).
    last_accepted_slot: Optional[torch.Tensor] = None
    # int32 [bs, D]: the tree verify's accepted path (flat rows, root first, -1 after),
    # set by verify() (for budget auto's accepted counts per candidate).
    accept_index: Optional[torch.Tensor] = None

    @classmethod
    def from_tree(
        cls,
        tree: ddtree_tree.DraftTree,
        root_tokens: torch.Tensor,
        prefix_lens: torch.Tensor,
        *,
        prefix_lens_cpu: Optional[torch.Tensor] = None,
    ) -> "DDTreeVerifyInput":
        """``prefix_lens_cpu``: the same lengths on the host (``tree_verify_inputs``)."""
        inputs = tree_verify_inputs(tree, root_tokens, prefix_lens, prefix_lens_cpu)
        return cls(
            draft_token=inputs.input_ids.reshape(-1),
            positions=inputs.positions.reshape(-1),
            draft_token_num=int(tree.num_slots),
            custom_mask=inputs.tree_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            retrieve_index=inputs.retrieve_index,
            retrieve_next_token=inputs.retrieve_next_token,
            retrieve_next_sibling=inputs.retrieve_next_sibling,
        )

    @classmethod
    def capture_dummy(
        cls, *, draft_token_num: int, custom_mask: torch.Tensor, is_draft_worker: bool
    ) -> "DDTreeVerifyInput":
        """The spec_info a CUDA graph is captured with: the target's carries the mask."""
        return cls(
            draft_token=None,
            positions=None,
            draft_token_num=int(draft_token_num),
            custom_mask=None if is_draft_worker else custom_mask,
            capture_hidden_mode=(
                CaptureHiddenMode.NULL if is_draft_worker else CaptureHiddenMode.FULL
            ),
        )

    def prepare_for_verify(
        self,
        batch: ScheduleBatch,
        page_size: int,
        *,
        build_custom_mask: bool = True,
    ):
        # The tree mask is needed on every backend, so `build_custom_mask` is ignored.
        if page_size != 1:
            raise RuntimeError(f"DDTREE requires page_size == 1, got {page_size}.")
        tree_mask = self.custom_mask
        super().prepare_for_verify(batch, page_size, build_custom_mask=False)
        self.custom_mask = tree_mask

    def _apply_sampling_adjustments(
        self, batch: ScheduleBatch, logits_output: LogitsProcessorOutput
    ) -> None:
        sampling_info = batch.sampling_info
        if sampling_info is None:
            return
        bs = batch.batch_size()
        if len(sampling_info) != bs:
            raise RuntimeError(
                f"DDTREE verify sampling_info size mismatch: {len(sampling_info)} vs bs={bs}."
            )
        if sampling_info.has_custom_logit_processor:
            apply_custom_logit_processor(
                logits_output.next_token_logits,
                sampling_info,
                num_tokens_in_batch=self.draft_token_num,
            )
        if (
            sampling_info.penalizer_orchestrator.is_required
            or sampling_info.logit_bias is not None
        ):
            linear_penalty = torch.zeros(
                (bs, logits_output.next_token_logits.shape[1]),
                dtype=torch.float32,
                device=logits_output.next_token_logits.device,
            )
            sampling_info.apply_logits_bias(linear_penalty)
            logits_output.next_token_logits.add_(
                torch.repeat_interleave(linear_penalty, self.draft_token_num, dim=0)
            )

    def _tree_verify(
        self, batch: ScheduleBatch, logits: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run SGLang's tree verify. Returns (predicts [bs*D] int32, accept_index [bs, D])."""
        bs = batch.batch_size()
        d = self.draft_token_num
        device = logits.device
        candidates = self.draft_token.view(bs, d)
        predicts = torch.empty((bs * d,), dtype=torch.int32, device=device)
        accept_index = torch.full((bs, d), -1, dtype=torch.int32, device=device)
        accept_token_num = torch.empty((bs,), dtype=torch.int32, device=device)
        sampling_info = batch.sampling_info
        greedy = sampling_info is None or sampling_info.is_all_greedy
        if greedy or not TREE_SPEC_KERNEL_AVAILABLE:
            from sglang.srt.speculative.eagle_utils import verify_tree_greedy_func

            verify_tree_greedy_func(
                predicts=predicts,
                accept_index=accept_index,
                accept_token_num=accept_token_num,
                candidates=candidates,
                retrieve_index=self.retrieve_index,
                retrieve_next_token=self.retrieve_next_token,
                retrieve_next_sibling=self.retrieve_next_sibling,
                target_predict=torch.argmax(logits, dim=-1).view(bs, d),
            )
            return predicts, accept_index

        from sgl_kernel import (
            top_k_renorm_prob,
            top_p_renorm_prob,
            tree_speculative_sampling_target_only,
        )

        # Target-only tree sampling: draft probabilities are zero, so every node is
        # accepted with the target's probability of its token and the output follows
        # the target distribution exactly.
        temperatures = torch.repeat_interleave(sampling_info.temperatures, d, dim=0)
        target_probs = F.softmax(logits / temperatures, dim=-1)
        target_probs = top_k_renorm_prob(
            target_probs, torch.repeat_interleave(sampling_info.top_ks, d, dim=0)
        )
        if sampling_info.need_top_p_sampling:
            target_probs = top_p_renorm_prob(
                target_probs, torch.repeat_interleave(sampling_info.top_ps, d, dim=0)
            )
        target_probs = target_probs.reshape(bs, d, -1)
        server_args = get_global_server_args()
        tree_speculative_sampling_target_only(
            predicts=predicts,
            accept_index=accept_index,
            accept_token_num=accept_token_num,
            candidates=candidates,
            retrive_index=self.retrieve_index,
            retrive_next_token=self.retrieve_next_token,
            retrive_next_sibling=self.retrieve_next_sibling,
            uniform_samples=torch.rand((bs, d), dtype=torch.float32, device=device),
            uniform_samples_for_final_sampling=torch.rand(
                (bs,), dtype=torch.float32, device=device
            ),
            target_probs=target_probs,
            draft_probs=torch.zeros_like(target_probs),
            threshold_single=server_args.speculative_accept_threshold_single,
            threshold_acc=server_args.speculative_accept_threshold_acc,
            deterministic=True,
        )
        return predicts, accept_index

    def verify(
        self,
        *,
        batch: ScheduleBatch,
        logits_output: LogitsProcessorOutput,
        page_size: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
        """Verify the trees, commit the accepted paths' KV, return what DFlash returns.

        Returns (new_bonus_tokens [bs] int64, commit_lens [bs] int32, next_target_hidden
        [sum(commit_lens), F], num_correct_drafts_per_req_cpu).
        """
        if batch.forward_mode.is_idle():
            empty = torch.empty((0,), dtype=torch.int64, device=batch.device)
            return empty, empty.to(torch.int32), empty, []
        if page_size != 1:
            raise RuntimeError(f"DDTREE requires page_size == 1, got {page_size}.")

        bs = batch.batch_size()
        d = self.draft_token_num
        logits = logits_output.next_token_logits
        device = logits.device
        self._apply_sampling_adjustments(batch, logits_output)
        predicts, accept_index = self._tree_verify(batch, logits)
        self.accept_index = accept_index

        # One D2H copy of the accepted paths (flat rows, root first) and the tokens.
        accept_index_cpu = accept_index.cpu().tolist()
        predicts_cpu = predicts.cpu().tolist()

        commit_lens_cpu: List[int] = []
        num_correct_drafts_per_req_cpu: List[int] = []
        new_bonus_tokens_list: List[int] = []
        last_slots: List[int] = []
        keep_rows: List[int] = []
        for i, req in enumerate(batch.reqs):
            path = [row for row in accept_index_cpu[i] if row >= 0]
            appended = 0
            for row in path:
                token_id = int(predicts_cpu[row])
                req.output_ids.append(token_id)
                appended += 1
                req.update_finish_state()
                if req.finished():
                    break
                if req.grammar is not None:
                    req.grammar.accept_token(token_id)
            # The KV of the root and the matched nodes stays; the last appended token
            # (the bonus) has no KV yet, exactly as in DFLASH.
            keep_rows.extend(path[:appended])
            last_slots.append(path[appended - 1] - i * d)
            commit_lens_cpu.append(appended)
            new_bonus_tokens_list.append(int(req.output_ids[-1]))
            num_correct = max(0, appended - 1)
            num_correct_drafts_per_req_cpu.append(num_correct)
            req.spec_verify_ct += 1
            req.spec_num_correct_drafts += num_correct
            if hasattr(req, "update_spec_correct_drafts_histogram"):
                req.update_spec_correct_drafts_histogram(num_correct)

        commit_lens = torch.tensor(commit_lens_cpu, dtype=torch.int32, device=device)
        new_bonus_tokens = torch.tensor(
            new_bonus_tokens_list, dtype=torch.int64, device=device
        )
        self.last_accepted_slot = torch.tensor(last_slots, dtype=torch.int64, device=device)
        keep = torch.tensor(keep_rows, dtype=torch.int64, device=device)

        # Page size 1: keep the accepted nodes' slots where they are, free the rest.
        evict = torch.ones((bs * d,), dtype=torch.bool, device=device)
        evict[keep] = False
        batch.token_to_kv_pool_allocator.free(batch.out_cache_loc[evict])
        batch.out_cache_loc = batch.out_cache_loc[keep]

        for req, commit_len in zip(batch.reqs, commit_lens_cpu, strict=True):
            req.kv_committed_len += commit_len
            req.kv_allocated_len = req.kv_committed_len

        # Accepted node k sits at depth k, position prefix + k: its KV slot becomes the
        # request's token at prefix + k.
        end_offset = batch.seq_lens + commit_lens.to(batch.seq_lens.dtype)
        assign_req_to_token_pool_func(
            batch.req_pool_indices,
            batch.req_to_token_pool.req_to_token,
            batch.seq_lens,
            end_offset,
            batch.out_cache_loc,
            bs,
        )
        batch.seq_lens.add_(commit_lens.to(batch.seq_lens.dtype))
        batch.seq_lens_cpu.add_(
            torch.tensor(commit_lens_cpu, dtype=batch.seq_lens_cpu.dtype)
        )
        batch.seq_lens_sum += sum(commit_lens_cpu)

        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify requires target hidden states, but got None.")
        next_target_hidden = hidden.view(bs * d, -1)[keep]
        logits_output.hidden_states = None

        return (
            new_bonus_tokens,
            commit_lens,
            next_target_hidden,
            num_correct_drafts_per_req_cpu,
        )
