"""DDTREE verify input for the spec-v2 DFlash worker.

The verify window (``D = budget + 1`` slots per request) holds a draft tree: slot 0
is the root (the previous bonus token), then the tree nodes, every parent before its
children. The target runs one TARGET_VERIFY pass under a FULL_MASK tree mask; positions are
``prefix + depth``. The worker walks the tree itself (``ddtree_tree.verify_walk``), so
this input carries none of the ``retrieve_*`` arrays SGLang's tree verify kernels read.
The algorithm itself lives in ``ddtree_tree.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative import ddtree_tree
from sglang.srt.speculative.ddtree_utils import tree_verify_inputs
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


class DDTreeVerifyInputV2(DFlashVerifyInput):
    """DFlash's verify input holding a tree: its tokens, positions and tree mask."""

    @classmethod
    def from_tree(
        cls,
        tree: ddtree_tree.DraftTree,
        root_tokens: torch.Tensor,
        prefix_lens: torch.Tensor,
        *,
        prefix_lens_cpu: Optional[torch.Tensor] = None,
        kv_loc_plan=None,
    ) -> "DDTreeVerifyInputV2":
        """``prefix_lens_cpu``: the same lengths on the host (``tree_verify_inputs``)."""
        inputs = tree_verify_inputs(tree, root_tokens, prefix_lens, prefix_lens_cpu)
        return cls.from_inputs(
            inputs.input_ids,
            inputs.positions,
            inputs.tree_mask,
            int(tree.num_slots),
            kv_loc_plan=kv_loc_plan,
        )

    @classmethod
    def from_inputs(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor,
        num_slots: int,
        *,
        kv_loc_plan=None,
    ) -> "DDTreeVerifyInputV2":
        """From built inputs: ``input_ids`` and ``positions`` ``[b, N]``, the flat mask
        (``ddtree_tree.verify_inputs``, or a verify graph's, ``ddtree_step_graphs_v2``)."""
        # The KV index plan exists from 0.5.22 on; earlier releases have no such field.
        plan = {} if kv_loc_plan is None else {"kv_loc_plan": kv_loc_plan}
        return cls(
            draft_token=input_ids.reshape(-1),
            positions=positions.reshape(-1),
            draft_token_num=int(num_slots),
            custom_mask=tree_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            **plan,
        )

    @classmethod
    def capture_dummy(
        cls,
        *,
        draft_token_num: int,
        custom_mask: Optional[torch.Tensor],
        is_draft_worker: bool,
    ) -> "DDTreeVerifyInputV2":
        """The spec_info a CUDA graph is captured with: the target's carries the mask,
        so triton and flashinfer bake the masked verify into the graph."""
        return cls(
            draft_token=None,
            positions=None,
            draft_token_num=int(draft_token_num),
            custom_mask=None if is_draft_worker else custom_mask,
            capture_hidden_mode=(
                CaptureHiddenMode.NULL if is_draft_worker else CaptureHiddenMode.FULL
            ),
        )
