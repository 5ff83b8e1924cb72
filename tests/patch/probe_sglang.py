"""Run inside the SGLang venv against a patched snapshot; print one JSON object of facts.

Usage: python probe_sglang.py SNAPSHOT_ROOT LAYOUT MODELS_DIR

It imports the patched modules on CPU and exercises what runs without a GPU: algorithm
lookup, the CLI parser, server-argument validation, the workers' argument checks, and the
DDTree verify input against SGLang's own tree-verify contract. It reports facts; the test
decides what is right. Nothing here imports ddtree_cli.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import json
import sys
import types
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
ROOT, LAYOUT, MODELS = sys.argv[1:4]
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative import ddtree_tree  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.speculative.spec_registry import CustomSpecAlgo  # noqa: E402

V2 = LAYOUT == "v2"
# Where the resolved arguments live. 0.5.13 and the v2 releases up to 0.5.18 resolve them in
# place in ServerArgs.__post_init__; from 0.5.19 resolution is a separate step read through
# a resolving view and published as the spec config.
try:
    from sglang.srt.arg_groups.model_override_base import resolving_view  # noqa: E402
except ImportError:
    resolving_view = None
SEPARATE_RESOLUTION = resolving_view is not None
out: dict = {"separate_resolution": SEPARATE_RESOLUTION}


def first_module(*names):
    """The first of these modules that this release has (SGLang moves its kernels)."""
    import importlib

    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the probe reports the error; the test judges it
        return f"{type(exc).__name__}: {exc}"
    return None


def server_args(**overrides) -> ServerArgs:
    if SEPARATE_RESOLUTION:  # 0.5.19 on: construction is cheap; resolution is a step
        return ServerArgs(**overrides)
    # Otherwise __post_init__ resolves everything (GPU probing); take the field defaults.
    args = ServerArgs.__new__(ServerArgs)
    for field in dataclasses.fields(ServerArgs):
        if field.default is not dataclasses.MISSING:
            setattr(args, field.name, field.default)
        elif field.default_factory is not dataclasses.MISSING:
            setattr(args, field.name, field.default_factory())
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def resolved(args, name):
    if SEPARATE_RESOLUTION:
        return getattr(resolving_view(args), name)
    return getattr(args, name)


# --- algorithm lookup and the plugin registry
algo = SpeculativeAlgorithm.from_string("ddtree")
out["algorithm"] = {
    "name": algo.name,
    "is_ddtree": algo.is_ddtree(),
    "is_dflash": algo.is_dflash(),
    "dflash_is_ddtree": SpeculativeAlgorithm.DFLASH.is_ddtree(),
}
out["plugin_register_error"] = error_of(
    lambda: SpeculativeAlgorithm.register("DDTREE_PROBE_PLUGIN", spec_class=CustomSpecAlgo)(
        lambda sa: object
    )
)
out["plugin_is_ddtree"] = SpeculativeAlgorithm.from_string("ddtree_probe_plugin").is_ddtree()

# --- the CLI parser
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(
    ["--model-path", "m", "--speculative-algorithm", "DDTREE",
     "--speculative-ddtree-budget", "15", "--speculative-ddtree-allow-hybrid"]
)  # fmt: skip
out["cli"] = {
    "algorithm": ns.speculative_algorithm,
    "budget": ns.speculative_ddtree_budget,
    "allow_hybrid": ns.speculative_ddtree_allow_hybrid,
}

# --- server-argument validation
from sglang.srt.arg_groups.speculative_hook import _handle_ddtree  # noqa: E402

base = dict(
    model_path=f"{MODELS}/dense", speculative_algorithm="DDTREE",
    speculative_draft_model_path=f"{MODELS}/dense", speculative_num_draft_tokens=16,
    attention_backend="triton", page_size=1, device="cuda",
)  # fmt: skip
cases = {
    "ok_triton": {},
    "ok_flashinfer": {"attention_backend": "flashinfer"},
    "page_size_4": {"page_size": 4},
    "fa3": {"attention_backend": "fa3"},
    "budget_7": {"speculative_ddtree_budget": 7},
    "hybrid": {"model_path": f"{MODELS}/hybrid"},
    "hybrid_override": {"model_path": f"{MODELS}/hybrid", "speculative_ddtree_allow_hybrid": True},
}


def handled(common: dict, case_overrides: dict, record) -> dict:
    """Per case: _handle_ddtree on common + the case's overrides; its error, and what
    ``record(args)`` reads from the resolved arguments when there was none."""
    facts = {}
    for name, overrides in case_overrides.items():
        args = server_args(**{**common, **overrides})
        err = error_of(lambda args=args: _handle_ddtree(args))
        facts[name] = {"error": err, **(record(args) if err is None else {})}
    return facts


out["handle"] = handled(base, cases, lambda args: {
    "budget": resolved(args, "speculative_ddtree_budget"),
    "disable_overlap_schedule": resolved(args, "disable_overlap_schedule"),
})  # fmt: skip

# --- budgets apart from the drafter's block: the block comes from the draft's
# dflash_config (16), the target's verify width is budget + 1.
block16 = {**base, "speculative_draft_model_path": f"{MODELS}/draft16",
           "speculative_num_draft_tokens": None}  # fmt: skip
budget_cases = {
    "default": {}, "budget_8": {"speculative_ddtree_budget": 8},
    "budget_15": {"speculative_ddtree_budget": 15},
    "budget_32": {"speculative_ddtree_budget": 32},
    "budget_64": {"speculative_ddtree_budget": 64},
    "budget_0": {"speculative_ddtree_budget": 0},
    "budget_huge": {"speculative_ddtree_budget": 100000},
    "explicit_block": {"speculative_dflash_block_size": 16, "speculative_ddtree_budget": 64},
}  # fmt: skip
if V2:
    # v2: the same split, but a verify width below the block is refused (every size
    # read from speculative_num_draft_tokens must hold the draft block as well).
    budget_cases["num_draft_tokens_block"] = {"speculative_num_draft_tokens": 16,
                                              "speculative_ddtree_budget": 64}  # fmt: skip

    if SEPARATE_RESOLUTION:
        from sglang.srt.arg_groups.overrides import (  # noqa: E402
            max_speculative_num_draft_tokens as max_draft_tokens_of,
        )
    else:

        def max_draft_tokens_of(args):  # a cached property, read after resolution
            return ServerArgs.max_speculative_num_draft_tokens.func(args)

    def sizing(args):  # what memory sizing reads
        return {"max_draft_tokens": max_draft_tokens_of(args)}
else:
    from sglang.srt.mem_cache.common import get_alloc_len_per_decode  # noqa: E402

    def sizing(args):
        return {"alloc_len_per_decode": get_alloc_len_per_decode(args)}


def resolved_widths(args) -> dict:
    entry = {
        "budget": resolved(args, "speculative_ddtree_budget"),
        "verify_width": resolved(args, "speculative_num_draft_tokens"),
        "block": resolved(args, "speculative_dflash_block_size"),
        **sizing(args),
    }
    err2 = error_of(lambda: _handle_ddtree(args))  # a second pass
    entry["rerun"] = [err2, resolved(args, "speculative_num_draft_tokens"),
                      resolved(args, "speculative_dflash_block_size")]  # fmt: skip
    return entry


out["budgets"] = handled(block16, budget_cases, resolved_widths)

# --- --speculative-ddtree-budget auto: the CLI's type, then _handle_ddtree (0.5.13 takes
# it; the v2 releases refuse it), then the v2 worker's own refusal
auto_parser = argparse.ArgumentParser(exit_on_error=False)
ServerArgs.add_cli_args(auto_parser)
auto_cli = {}
for value in ("auto", "AUTO", "64", "autox"):
    try:
        auto_cli[value] = auto_parser.parse_args(
            ["--model-path", "m", "--speculative-ddtree-budget", value]
        ).speculative_ddtree_budget
    except argparse.ArgumentError as exc:
        auto_cli[value] = f"ArgumentError: {exc}"
out["auto_cli"] = auto_cli
out["budget_help"] = next(
    a.help for a in auto_parser._actions if "--speculative-ddtree-budget" in a.option_strings
)
auto_cases = {
    "auto": {"speculative_ddtree_budget": "auto"},
    "auto_max_48": {"speculative_ddtree_budget": "auto", "speculative_ddtree_max_budget": 48},
    "auto_max_8": {"speculative_ddtree_budget": "auto", "speculative_ddtree_max_budget": 8},
    "auto_max_huge": {"speculative_ddtree_budget": "auto",
                      "speculative_ddtree_max_budget": 5000},
    "max_without_auto": {"speculative_ddtree_budget": 15, "speculative_ddtree_max_budget": 64},
    "auto_tp2": {"speculative_ddtree_budget": "auto", "tp_size": 2},
    "auto_flashinfer": {"speculative_ddtree_budget": "auto", "attention_backend": "flashinfer"},
    "autox": {"speculative_ddtree_budget": "autox"},
}  # fmt: skip
if V2:  # only the first: the others are the same error there
    auto_cases = {"auto": auto_cases["auto"]}


def auto_widths(args) -> dict:
    entry = resolved_widths(args)
    entry["max_budget"] = resolved(args, "speculative_ddtree_max_budget")
    return entry


out["budget_auto"] = handled(block16, auto_cases, auto_widths)

# --- the workers know their algorithm
if V2:
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2 as TreeWorker
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2 as ChainWorker

    # The chain worker's constructor arguments differ between releases (0.5.17 and 0.5.18
    # take a ParallelState too); the target worker is always last.
    _chain_params = list(inspect.signature(ChainWorker.__init__).parameters)[2:]

    def construct(cls, args):
        return cls(args, *([0] * (len(_chain_params) - 1)), None)
else:
    from sglang.srt.speculative.ddtree_worker import DDTreeWorker as TreeWorker
    from sglang.srt.speculative.dflash_worker import DFlashWorker as ChainWorker

    def construct(cls, args):
        return cls(args, 0, 0, None, 0, 0, 0, 0, None)

    def construct_v1_with(args, target_worker, chain=False):
        cls = ChainWorker if chain else TreeWorker
        return cls(args, 0, 0, None, 0, 0, 0, 0, target_worker)


def scheduler_ddtree_state(worker, algorithm=algo) -> dict:
    """What the patched scheduler's ``get_internal_state`` adds for ``worker`` (the draft
    worker it holds) under ``algorithm``, on a stand-in scheduler. From 0.5.22 SGLang reads
    the state in its internal-state controller: its real ``_add_speculative`` runs. Before,
    ``Scheduler.get_internal_state`` reads the whole server (memory pools, device memory,
    parallel state): the DDTREE statement of the imported method runs as it stands there,
    in the scheduler module's globals, with ``self`` the stand-in and ``ret`` the answer."""
    import textwrap

    from sglang.srt.managers import scheduler as scheduler_module

    stand_in = types.SimpleNamespace(
        spec_algorithm=algorithm, draft_worker=worker,
        metrics_reporter=types.SimpleNamespace(
            spec_total_num_forward_ct=0, spec_total_num_accept_tokens=0
        ),
    )  # fmt: skip
    controller = getattr(scheduler_module, "SchedulerInternalStateController", None)
    if controller is not None:
        state: dict = {}
        controller(scheduler=stand_in, record_step_time=False)._add_speculative(state)
        return {"where": "SchedulerInternalStateController._add_speculative", "state": state}
    method = ast.parse(
        textwrap.dedent(inspect.getsource(scheduler_module.Scheduler.get_internal_state))
    ).body[0]
    hooks = [
        node for node in method.body
        if isinstance(node, ast.If) and "is_ddtree" in ast.unparse(node.test)
    ]  # fmt: skip
    ret: dict = {}
    for hook in hooks:
        code = compile(ast.Module(body=[hook], type_ignores=[]), scheduler_module.__file__, "exec")
        exec(code, dict(vars(scheduler_module)), {"self": stand_in, "ret": ret})
    return {"where": f"Scheduler.get_internal_state ({len(hooks)} DDTREE statement)", "state": ret}


if V2:  # the v2 worker refuses auto itself, whatever reached it
    out["tree_worker_auto"] = error_of(
        lambda: construct(TreeWorker, server_args(**{**base, "speculative_ddtree_budget": "auto"}))
    )
else:
    # budget auto's statistics per candidate from one round at the largest budget, against
    # each candidate's own tree built and walked separately (the prefix order, and the
    # mapping from SGLang's flat accept_index rows to tree slots)
    from sglang.srt.speculative.ddtree_worker import _tree_stats  # noqa: E402

    def tree_stats_case(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        bs, n_pos, vocab, budgets = 3, 15, 40, (15, 32, 64)
        logits = torch.randn(bs, n_pos, vocab, generator=gen) * 3.0
        # the target's greedy continuation: mostly the draft's argmax, some rows diverge
        truth = logits.argmax(-1)
        flip = torch.rand(bs, n_pos, generator=gen) < 0.25
        truth = torch.where(flip, (truth + 1) % vocab, truth)

        def walk_of(tree):
            # a node at depth d is followed, under the target, by truth[d] (its value at
            # nodes off the true path is never read: the walk does not reach them)
            target = truth.gather(1, tree.depths.clamp(max=n_pos - 1))
            return ddtree_tree.verify_walk(tree, target)

        big = ddtree_tree.build_tree(logits, budgets[-1])
        walk = walk_of(big)
        d = big.num_slots
        acc = walk.accepted
        rows = torch.where(acc >= 0, acc + torch.arange(bs).unsqueeze(1) * d, -1)
        accept_index = torch.full((bs, d), -1, dtype=torch.int32)
        accept_index[:, : rows.shape[1]] = rows[:, :d].to(torch.int32)
        got = _tree_stats(big, accept_index, torch.tensor(budgets)).tolist()
        want_values, want_accepted = [], []
        for b in budgets:
            small = ddtree_tree.build_tree(logits, b)
            want_values.append(float(small.scores[:, 1:].exp().sum()))
            want_accepted.append(int((walk_of(small).accept_len - 1).sum()))
        probe_only = _tree_stats(big, None, torch.tensor(budgets)).tolist()
        return {"got": got, "want": [want_values, want_accepted], "no_walk": probe_only}

    out["tree_stats"] = [tree_stats_case(seed) for seed in (0, 1, 2)]

    # the round timing /server_info shows, and what the worker hands the scheduler's
    # get_internal_state (with and without a policy)
    from sglang.srt.speculative import ddtree_budget_policy  # noqa: E402
    from sglang.srt.speculative.ddtree_round_timing import RoundTiming  # noqa: E402

    timing = RoundTiming(window=2)
    for i, (bucket, width) in enumerate([(1, 65), (1, 65), (1, 65), (16, 16)]):
        start = 10.0 + i * 0.012  # rounds 12 ms apart, each 10 ms long
        timing.record(bucket, width, start=start, end=start + 0.010, build=0.001 * (i + 1))
    timing.record(1, 65, start=20.0, end=20.010, build=0.001, policy=0.0005)  # after idle
    worker = object.__new__(TreeWorker)
    worker.round_timing, worker.policy = timing, None
    fixed_state = sorted(worker.ddtree_internal_state())
    from_scheduler = scheduler_ddtree_state(worker)
    worker.policy = ddtree_budget_policy.BudgetPolicy((15, 32, 64))
    out["round_timing"] = {
        "snapshot": timing.snapshot(),
        "fixed_state": fixed_state,
        "auto_state": sorted(worker.ddtree_internal_state()),
        "scheduler_reads_it": "ddtree_internal_state"
        in Path(ROOT, "sglang/srt/managers/scheduler.py").read_text(encoding="utf-8"),
        "scheduler_where": from_scheduler["where"],
        "scheduler_state": sorted(from_scheduler["state"]),
        "scheduler_snapshot_equal": from_scheduler["state"]["speculative_ddtree_round_timing"]
        == timing.snapshot(),
    }

    # budget auto's round time as the policy gets it: the host time of the round itself
    # (DFlash's forward, draft to commit, here a stand-in of a known length that builds
    # the round's tree as the worker's _build_verify_input does), not the policy's own work
    # before it (a plan made slow on purpose) or after it, as the round ends (its tree
    # statistics a round later); a prefill between rounds is a part of the next one's gap
    import time as _time  # noqa: E402

    from sglang.srt.speculative import ddtree_worker as _v1_worker  # noqa: E402
    from sglang.srt.speculative.dflash_worker import DFlashWorker  # noqa: E402

    DRAFT_S, VERIFY_S = 0.012, 0.008  # the drafter's pass; the verify and the commit
    ROUND_S, PLAN_S = DRAFT_S + VERIFY_S, 0.2  # the plan far longer than any CPU hiccup
    PREFILL_S = 0.03
    PREFILL_TOKENS = 24

    class _SlowPlan(ddtree_budget_policy.BudgetPolicy):
        def __init__(self, budgets):
            super().__init__(budgets)
            self.seen, self.stats = [], []

        def plan(self, batch):
            _time.sleep(PLAN_S)
            return super().plan(batch)

        def observe_time(self, batch, budget, seconds, **kw):
            self.seen.append([budget, seconds])
            super().observe_time(batch, budget, seconds, **kw)

        def observe_stats(self, batch, budget, **kw):
            self.stats.append(budget)
            super().observe_stats(batch, budget, **kw)

    class _Event:  # the CPU torch cannot make a torch.cuda.Event
        def record(self):
            pass

        def query(self):
            return True

    def parent_round(self, batch, **kwargs):
        """DFlash's round: the drafter's pass, the worker's own _build_verify_input (the
        real one: head top-K and tree from a stand-in for the round graphs, verify inputs,
        the round's width), then the verify and the commit, which set the accepted path."""
        if batch.forward_mode.is_extend():
            _time.sleep(PREFILL_S)
            return "prefill result"
        _time.sleep(DRAFT_S)
        verify_input = self._build_verify_input(
            batch=batch,
            draft_hidden=torch.randn(2, 16, 8),
            lm_head=None,
            block_ids=torch.zeros((2, 16), dtype=torch.long),
            positions_2d=None,
        )
        _time.sleep(VERIFY_S)
        slots = verify_input.draft_token_num
        accept_index = torch.full((2, slots), -1, dtype=torch.int32)
        accept_index[:, 0] = torch.arange(2, dtype=torch.int32) * slots  # the roots
        verify_input.accept_index = accept_index
        return "round result"

    def round_graphs(hidden, k, budget):  # what DraftRoundGraphs returns, on the CPU
        logprobs, ids = torch.log_softmax(torch.randn(hidden.shape[0], 15, 80), -1).topk(k)
        return logprobs, ids, ddtree_tree.build_tree_from_topk(logprobs, ids, budget)

    def auto_round_times(modes):
        """Rounds of 2 requests through the v1 worker's forward_batch_generation, each
        mode "decode" or "extend" (a prefill)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

        policy = _SlowPlan((15, 32, 64))
        worker = object.__new__(TreeWorker)
        worker.policy, worker._round, worker._pending = policy, None, None
        worker._parity = worker._planned = 0
        worker.round_timing, worker.round_budget = RoundTiming(), policy.max_budget
        worker._candidates = _v1_worker.candidate_tensors(policy.budgets, "cpu")
        worker._host_stats = [
            {b: torch.empty((2, len(worker._candidates[b]))) for b in policy.budgets}
            for _ in range(2)
        ]
        worker._host_probe = [torch.empty(len(policy.budgets)) for _ in range(2)]
        worker.budget, worker._round_graphs = policy.max_budget, round_graphs
        worker._graph_runners = {}
        worker.target_worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(attn_backend=types.SimpleNamespace())
        )
        batches = [
            types.SimpleNamespace(
                forward_mode=ForwardMode.EXTEND if m == "extend" else ForwardMode.DECODE,
                batch_size=lambda: 2,
                seq_lens=torch.tensor([8, 8]),
                seq_lens_cpu=torch.tensor([8, 8]),
                # ScheduleBatch's field: the tokens an extend prefills (None when decoding)
                extend_num_tokens=PREFILL_TOKENS if m == "extend" else None,
            )
            for m in modes
        ]
        saved = DFlashWorker.forward_batch_generation, _v1_worker.torch.cuda.Event
        DFlashWorker.forward_batch_generation, _v1_worker.torch.cuda.Event = parent_round, _Event
        try:
            results = [worker.forward_batch_generation(b) for b in batches]
        finally:
            DFlashWorker.forward_batch_generation, _v1_worker.torch.cuda.Event = saved
        return {
            "results": results,
            "timing": worker.round_timing.snapshot(),
            "observed": policy.seen,
            "stats": policy.stats,
        }

    out["auto_round_time"] = {
        "draft_s": DRAFT_S,
        "verify_s": VERIFY_S,
        "round_s": ROUND_S,
        "plan_s": PLAN_S,
        "prefill_s": PREFILL_S,
        "prefill_tokens": PREFILL_TOKENS,
        **auto_round_times(["decode", "extend", "decode", "decode", "decode"]),
    }

out["tree_worker_with_dflash"] = error_of(
    lambda: construct(TreeWorker, server_args(**{**base, "speculative_algorithm": "DFLASH"}))
)
out["chain_worker_with_eagle"] = error_of(
    lambda: construct(ChainWorker, server_args(**{**base, "speculative_algorithm": "EAGLE"}))
)
out["create_worker"] = {}
for overlap_off in (True, False):
    args = server_args(**{**base, "disable_overlap_schedule": overlap_off})
    try:
        out["create_worker"][str(overlap_off)] = algo.create_worker(args).__name__
    except Exception as exc:
        out["create_worker"][str(overlap_off)] = f"{type(exc).__name__}: {exc}"

# --- the verify input, against what SGLang's kernels and triton backend read
if V2:
    from sglang.srt.speculative.ddtree_info_v2 import DDTreeVerifyInputV2 as VerifyInput
else:
    from sglang.srt.speculative.ddtree_info import DDTreeVerifyInput as VerifyInput


def kernel_walk(candidates, retrieve_index, next_token, next_sibling, target_predict):
    """SGLang's greedy tree verify, step by step as its kernels define it: from the last
    accepted node go to its first child, then along next siblings, until a child's token
    equals the target's token at the last accepted node (spec_tree.py, tree.cuh)."""
    bs, d = candidates.shape
    accept = torch.full((bs, d), -1, dtype=torch.int64)
    for b in range(bs):
        last = int(retrieve_index[b, 0])
        accept[b, 0] = last
        cur = 0
        for step in range(1, d):
            cur = int(next_token[b, cur])
            target = int(target_predict.view(-1)[last])
            while cur != -1 and int(candidates[b, cur]) != target:
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
            last = int(retrieve_index[b, cur])
            accept[b, step] = last
    return accept


CACHE_LOCS = first_module(
    "sglang.kernels.ops.speculative.cache_locs", "sglang.srt.speculative.triton_ops.cache_locs"
)


gen = torch.Generator().manual_seed(0)
host_sized = {"checked": 0, "mismatches": 0}  # the tree mask sized from host lengths
wide = {}  # budget -> facts, for budgets apart from block - 1 (15 drafted positions)
for budget in (15, 8, 64):  # 15 first: its draws are the ones the checks were written on
    mask_errors, position_errors, walk_mismatch, trials = [], 0, 0, 0
    deepest, widths = 0, set()
    for trial in range(12 if budget == 15 else 4):
        bs, n_pos, vocab = 3, 15, 40 + trial
        logits = torch.randn(bs, n_pos, vocab, generator=gen) * 2.0
        tree = ddtree_tree.build_tree(logits, budget)
        prefix = torch.randint(0, 30, (bs,), generator=gen)
        roots = torch.randint(0, vocab, (bs,), generator=gen)
        vi = VerifyInput.from_tree(tree, roots, prefix)
        host = VerifyInput.from_tree(tree, roots, prefix, prefix_lens_cpu=prefix.clone())
        host_sized["checked"] += 1
        host_sized["mismatches"] += int(
            not torch.equal(host.custom_mask, vi.custom_mask)
            or not torch.equal(host.draft_token, vi.draft_token)
        )
        d = vi.draft_token_num
        widths.add(d)
        # Triton backend (TARGET_VERIFY): mask_indptr = cumsum(D * (seq_lens + D)); row q of
        # request b starts at mask_indptr[b] + q * (seq_lens[b] + D); True = may attend.
        seq_mask_len = d * (prefix + d)
        mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(seq_mask_len, 0)])
        if vi.custom_mask.numel() != int(mask_indptr[-1]):
            mask_errors.append(f"numel {vi.custom_mask.numel()} != {int(mask_indptr[-1])}")
        for b in range(bs):
            p = int(prefix[b])
            block = vi.custom_mask[int(mask_indptr[b]) : int(mask_indptr[b + 1])].view(d, p + d)
            if not bool(block[:, :p].all()):
                mask_errors.append(f"prefix columns of request {b} not all visible")
            # ancestor-or-self from the parent chain, independently of ddtree_tree
            parents = tree.parents[b].tolist()
            for q in range(d):
                allowed = set()
                node = q
                while node >= 0:
                    allowed.add(node)
                    node = parents[node] if node <= int(tree.num_nodes[b]) else -1
                row = [bool(x) for x in block[q, p:]]
                if row != [k in allowed for k in range(d)]:
                    mask_errors.append(f"request {b} row {q}")
        expected_pos = (prefix.unsqueeze(1) + tree.depths).reshape(-1)
        position_errors += int((vi.positions.cpu() != expected_pos).sum())

        # A target that follows a random drafted path, so deep acceptance is exercised.
        candidates = vi.draft_token.view(bs, d)
        target = torch.randint(0, vocab, (bs, d), generator=gen)
        for b in range(bs):
            if trial % 2:  # the deepest node, else a random one
                node = int(torch.argmax(tree.depths[b]))
            else:
                node = int(torch.randint(1, int(tree.num_nodes[b]) + 1, (1,), generator=gen))
            while node > 0:
                parent = int(tree.parents[b, node])
                target[b, parent] = candidates[b, node]
                node = parent
        flat_target = target.reshape(-1)
        walk = ddtree_tree.verify_walk(tree, target)
        offsets = torch.arange(bs).unsqueeze(1) * d
        reference = torch.full((bs, d), -1, dtype=torch.int64)
        # A path has at most min(L + 1, budget + 1) nodes: the walk's and the kernels'
        # tables are both at least that wide.
        width = min(walk.accepted.shape[1], d)
        accepted = walk.accepted[:, :width]
        reference[:, :width] = torch.where(accepted >= 0, accepted + offsets, -1)
        deepest = max(deepest, int(walk.accept_len.max()))
        if not V2:  # the v1 worker's accept walks the retrieve arrays with SGLang's kernel
            args = (candidates, vi.retrieve_index, vi.retrieve_next_token,
                    vi.retrieve_next_sibling)  # fmt: skip
            walk_mismatch += int((kernel_walk(*args, flat_target) != reference).any(1).sum())
        trials += bs

    wide[budget] = {
        "trials": trials, "widths": sorted(widths), "mask_errors": mask_errors[:5],
        "position_errors": position_errors,
        "kernel_walk_mismatches": None if V2 else walk_mismatch, "deepest_accept_len": deepest,
    }  # fmt: skip
    if budget == 15:
        break_facts = (mask_errors, position_errors, walk_mismatch, trials, deepest, d, vi)
out["verify_input_budgets"] = {str(k): v for k, v in wide.items()}
mask_errors, position_errors, walk_mismatch, trials, deepest, d, vi = break_facts
out["verify_input"] = {
    "trials": trials,
    "mask_errors": mask_errors[:5],
    "position_errors": position_errors,
    "kernel_walk_mismatches": None if V2 else walk_mismatch,
    "deepest_accept_len": deepest,
    "draft_token_num": d,
    "retrieve_dtype": None if V2 else str(vi.retrieve_index.dtype),
    "host_sized_mask": host_sized,
}
dummy_mask = torch.ones(8, dtype=torch.bool)
target_dummy = VerifyInput.capture_dummy(
    draft_token_num=16, custom_mask=dummy_mask, is_draft_worker=False
)
draft_dummy = VerifyInput.capture_dummy(
    draft_token_num=16, custom_mask=dummy_mask, is_draft_worker=True
)
out["capture_dummy"] = {
    "target_has_mask": target_dummy.custom_mask is dummy_mask,
    "draft_has_mask": draft_dummy.custom_mask is not None,
    "target_capture_hidden": target_dummy.capture_hidden_mode.name,
    "draft_capture_hidden": draft_dummy.capture_hidden_mode.name,
}
if not V2:
    out["prepare_page_size_4"] = error_of(lambda: vi.prepare_for_verify(types.SimpleNamespace(), 4))


# --- one verify round end to end on CPU, with stand-ins only for the GPU: the CUDA
# greedy-verify op the v1 worker calls (replaced by its transcription: 0.5.13 has it in
# sgl_kernel only; the v2 worker walks the tree with ddtree_tree), the KV allocator and the
# requests. SGLang's Triton bookkeeping kernels run for real in the Triton interpreter.
def greedy_standin(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                   retrieve_next_token, retrieve_next_sibling, target_predict, **_):  # fmt: skip
    accept = kernel_walk(candidates, retrieve_index, retrieve_next_token,
                         retrieve_next_sibling, target_predict.reshape(-1))  # fmt: skip
    accept_index.copy_(accept.to(accept_index.dtype))
    accept_token_num.copy_(((accept >= 0).sum(1) - 1).to(accept_token_num.dtype))
    flat = target_predict.reshape(-1)
    for row in accept[accept >= 0].tolist():
        predicts[row] = flat[row]
    return predicts, accept_index, accept_token_num


class CacheLocsTranscribed:
    """SGLang's ``assign_extend_cache_locs`` Triton kernel, transcribed: each request's
    req_to_token[row, start:end], packed one request after another (cache_locs.py). Used
    only where the Triton interpreter cannot run the kernel (triton 3.6, the pin of torch
    2.11: a scalar load yields a one-element array); the probe reports which ran."""

    def __getitem__(self, grid):
        def run(req_pool_indices, req_to_token, start_offset, end_offset, out, *_):
            pos = 0
            for b in range(int(grid[0])):
                start, end = int(start_offset[b]), int(end_offset[b])
                row = req_to_token[int(req_pool_indices[b])]
                out[pos : pos + end - start] = row[start:end].to(out.dtype)
                pos += end - start

        return run


def cache_locs_kernel_runs() -> str | None:
    """None when SGLang's cache-loc kernel runs in the Triton interpreter, else why not."""
    cache_locs = CACHE_LOCS
    req_to_token = torch.arange(8, dtype=torch.int32).view(2, 4)
    out = torch.zeros(3, dtype=torch.int64)
    try:
        cache_locs.assign_extend_cache_locs[(2,)](
            torch.tensor([1, 0]), req_to_token, torch.tensor([1, 2]), torch.tensor([3, 3]),
            out, 4, 2,
        )  # fmt: skip
    except Exception as exc:  # the probe reports it; the test decides
        return f"{type(exc).__name__}: {exc}"
    assert out.tolist() == [5, 6, 2], out.tolist()
    return None


if V2:
    out["cache_locs_kernel_error"] = cache_locs_kernel_runs()
    if out["cache_locs_kernel_error"] is not None:
        from sglang.srt.speculative import spec_utils as _spec_utils  # noqa: E402

        _spec_utils.assign_extend_cache_locs = CacheLocsTranscribed()


class FakeReq:
    """The Req fields a verify round touches; finishes after max_new_tokens outputs."""

    def __init__(self, max_new_tokens):
        self.output_ids, self.max_new_tokens, self.grammar = [], max_new_tokens, None
        self.spec_verify_ct = self.spec_num_correct_drafts = 0
        self.kv_committed_len = self.kv_allocated_len = 0
        self._finished = False

    def update_finish_state(self):
        self._finished = len(self.output_ids) >= self.max_new_tokens

    def finished(self):
        return self._finished


class FakeAllocator:
    """The KV allocator and pool: slot ``i`` holds the value ``i`` until a move copies
    another slot's value onto it (every source read before any target is written, as the
    pool's copy kernel does)."""

    def __init__(self, slots: int = 512):
        self.freed, self.moves = [], 0
        self.kv = torch.arange(slots)
        self.targets = []  # every real slot (not the padding slot 0) a move wrote

    def free(self, slots):
        self.freed.extend(slots.tolist())

    def get_kvcache(self):
        return self

    def move_kv_cache(self, tgt, src):
        self.moves += 1
        self.targets += sorted(tgt[tgt != 0].tolist())
        self.kv[tgt] = self.kv[src].clone()


def commit_kernel_case(tree, target, prefix, window) -> str | None:
    """The v2 commit's Triton kernel (in Triton's interpreter) against its PyTorch path:
    None when every output is equal, else which differ (or why the kernel did not run)."""
    from sglang.srt.speculative.ddtree_commit_v2 import commit_round

    if not ddtree_tree._want_triton(target, True):
        return "the kernel would not run (no Triton, or not under its interpreter)"
    walk = ddtree_tree.verify_walk(tree, target)
    eager = commit_round(walk, target, prefix, window, use_triton=False)
    try:
        fused = commit_round(walk, target, prefix, window, use_triton=True)
    except Exception as exc:  # the test decides
        return f"{type(exc).__name__}: {exc}"
    differ = [
        name
        for name in (
            "out_tokens",
            "num_correct",
            "commit_lens",
            "new_seq_lens",
            "kv_targets",
            "kv_sources",
            "hidden_rows",
        )  # fmt: skip
        if not torch.equal(getattr(eager, name), getattr(fused, name))
    ]
    return ", ".join(differ) or None


def real_mha_pool(slots: int, layers: int = 2, heads: int = 2, dim: int = 8):
    """SGLang's own ``MHATokenToKVPool`` with small CPU buffers: the fields its move reads set
    here (its constructor's arguments differ between releases), its copy configuration from
    its own ``_init_kv_copy_and_warmup`` (which runs its tiled copy kernel once)."""
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = object.__new__(MHATokenToKVPool)
    if "use_native_move_kv_cache" in inspect.getsource(MHATokenToKVPool.__init__):
        pool.use_native_move_kv_cache = envs.SGLANG_NATIVE_MOVE_KV_CACHE.get()  # 0.5.16 on
    shape = (slots + 1, heads, dim)
    k = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    pool.__dict__.update(
        size=slots, page_size=1, layer_num=layers, device="cpu", dtype=torch.bfloat16,
        head_num=heads, head_dim=dim, k_buffer=k, v_buffer=v, use_hnd=False,
        start_layer=0, end_layer=layers - 1,
        data_ptrs=torch.tensor([t.data_ptr() for t in k + v], dtype=torch.int64),
        data_strides=torch.tensor([heads * dim * 2] * (2 * layers), dtype=torch.int64),
        k_scale_buffer=None, v_scale_buffer=None, native_k_scale_buffer=None,
        native_v_scale_buffer=None,
    )  # fmt: skip
    pool._init_kv_copy_and_warmup()
    return pool


def kv_move_choice() -> dict:
    """Which KV move the v2 worker's ``_kv_move`` picks: ``window_kv_move`` where the pool is
    SGLang's plain ``MHATokenToKVPool`` on its tiled copy, unless
    ``SGLANG_DDTREE_WINDOW_KV_MOVE`` is off; a pool of another kind, a quantised one and one
    under SGLang's own native-move switch keep their own."""
    from sglang.srt.speculative.ddtree_commit_v2 import WINDOW_MOVE_ENV

    def picked(pool, env):
        worker = TreeWorker.__new__(TreeWorker)
        worker._target_worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(
                token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: pool)
            )
        )
        with environ(**{WINDOW_MOVE_ENV: env}):
            return worker._kv_move().__qualname__.split(".")[0]

    real, fake, scaled = real_mha_pool(64), FakeAllocator(), real_mha_pool(64)
    scaled.native_k_scale_buffer = [torch.ones(65)]  # quantised KV: its scales move too
    with environ(SGLANG_NATIVE_MOVE_KV_CACHE="1"):  # the pool's attribute, or read per move
        native = picked(real_mha_pool(64), "1")
    return {
        "default": picked(real, None),
        "on": picked(real, "1"),
        "off": picked(real, "0"),
        "default_other_pool": picked(FakeAllocator(), None),
        "on_other_pool": picked(fake, "1"),
        "on_quantised_pool": picked(scaled, "1"),
        "on_native_move": native,
        "check": picked(real_mha_pool(64), "check"),
        "check_other_pool": picked(FakeAllocator(), "check"),
    }


@contextlib.contextmanager
def environ(**values):
    """``os.environ`` with ``values`` set (None: unset) inside the block, as before after it."""
    import os

    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def window_move_case(walk, target, prefix, window) -> str | None:
    """``ddtree_commit_v2.window_kv_move`` (in Triton's interpreter) against SGLang's own
    ``MHATokenToKVPool.move_kv_cache`` (its tiled copy kernel, interpreted too) on the
    release's real pool class with small CPU buffers, rows of whole 8-byte words (copied a
    word at a time) and of 6 bytes (a byte at a time), for the moves ``commit_round`` computes
    from this round: None when every buffer ends equal and something moved, else what
    differs (or why it did not run)."""
    from sglang.srt.speculative.ddtree_commit_v2 import commit_round

    if not ddtree_tree._want_triton(target, True):
        return "the kernel would not run (no Triton, or not under its interpreter)"
    commit = commit_round(walk, target, prefix, window, use_triton=False)
    moves = (commit.kv_targets, commit.kv_sources, commit.commit_lens)
    for heads, dim in ((2, 8), (1, 3)):
        try:
            pool = real_mha_pool(int(window.max()) + 8, heads=heads, dim=dim)
            differ = _moves_differ(pool, moves)
        except Exception as exc:  # the test decides
            return f"{heads}x{dim}: {type(exc).__name__}: {exc}"
        if differ:
            return f"{heads}x{dim}: {differ}"
    return None


def _moves_differ(pool, moves) -> str | None:
    """The pool's own move against ``window_kv_move`` from the same state."""
    from sglang.srt.speculative.ddtree_commit_v2 import pool_move, window_kv_move

    mover = window_kv_move(pool)
    if mover is None:
        return "window_kv_move refused SGLang's own MHATokenToKVPool"
    bufs = pool.k_buffer + pool.v_buffer
    start = [t.clone() for t in bufs]
    pool_move(pool)(*moves)
    own = [t.clone() for t in bufs]
    for t, s0 in zip(bufs, start, strict=True):
        t.copy_(s0)
    mover(*moves)
    if not all(torch.equal(a, t) for a, t in zip(own, bufs, strict=True)):
        return "the buffers differ from the pool's own move"
    if all(torch.equal(a, s0) for a, s0 in zip(own, start, strict=True)):
        return "nothing moved"
    return _checked_move_differs(pool, moves, mover, start, own)


def _checked_move_differs(pool, moves, window, start, own) -> str | None:
    """``checked_kv_move`` (``SGLANG_DDTREE_WINDOW_KV_MOVE=check``) from the same state: with
    the window move it leaves the pool's own result and counts one round, no difference;
    with a "fast" move that moves nothing it still leaves the pool's own result and counts
    the round as differing, by the moved rows."""
    from sglang.srt.speculative.ddtree_commit_v2 import checked_kv_move, pool_move

    bufs = pool.k_buffer + pool.v_buffer
    moved = sum(int((a != s0).reshape(a.shape[0], -1).any(1).sum())
                for a, s0 in zip(own, start, strict=True))  # fmt: skip
    for fast, want in ((window, [1, 0, 0]), (lambda *_: None, [1, 1, moved])):
        for t, s0 in zip(bufs, start, strict=True):
            t.copy_(s0)
        checked = checked_kv_move(pool, fast, pool_move(pool))
        checked(*moves)
        if not all(torch.equal(a, t) for a, t in zip(own, bufs, strict=True)):
            return "checked_kv_move did not leave the pool's own move's result"
        if checked.counts.tolist() != want or checked.snapshot()["differing_rows"] != want[2]:
            return f"checked_kv_move counted {checked.counts.tolist()}, not {want}"
    return None


def verify_round(budget: int) -> dict:
    bs, d, vocab, hidden_size, block = 3, budget + 1, 48, 8, 16
    # A block-16 drafter drafts 15 positions, whatever the budget.
    tree = ddtree_tree.build_tree(torch.randn(bs, 15, vocab, generator=gen) * 4.0, budget)
    prefix = torch.tensor([4, 9, 0], dtype=torch.int32)
    roots = torch.tensor([1, 2, 3])
    vi = VerifyInput.from_tree(tree, roots, prefix)
    candidates = vi.draft_token.view(bs, d)
    target = torch.randint(0, vocab, (bs, d), generator=gen)
    for b in range(bs):
        node = int(torch.argmax(tree.depths[b]))
        while node > 0:
            parent = int(tree.parents[b, node])
            target[b, parent] = candidates[b, node]
            node = parent
    logits = torch.full((bs * d, vocab), -10.0)
    logits[torch.arange(bs * d), target.reshape(-1)] = 10.0
    hidden = torch.randn(bs * d, hidden_size, generator=gen)
    walk = ddtree_tree.verify_walk(tree, target)
    expected_tokens = ddtree_tree.committed_tokens(tree, walk)
    window = torch.arange(100, 100 + bs * d, dtype=torch.int64)
    allocator = FakeAllocator()
    round_facts = {"walk_accept_len": walk.accept_len.tolist()}

    if V2:
        worker = TreeWorker.__new__(TreeWorker)
        worker.block_size, worker.verify_width = block, d
        worker._target_worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(token_to_kv_pool_allocator=allocator)
        )
        worker._tree, worker._verify_input, worker._accept_rows = tree, vi, None
        # req_to_token maps each request's verify window (releases before 0.5.19 read the
        # move targets from it, later ones from the window itself).
        pool_rows = torch.tensor([2, 0, 3])
        req_to_token = torch.zeros((4, 200), dtype=torch.int32)
        for b in range(bs):
            p = int(prefix[b])
            req_to_token[int(pool_rows[b]), p : p + d] = window.view(bs, d)[b].to(torch.int32)
        worker._verify_batch = types.SimpleNamespace(
            seq_lens=prefix.to(torch.int64), out_cache_loc=window.clone(),
            req_pool_indices=pool_rows,
            req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        )  # fmt: skip
        # The caller hands over its [bs, block] token block (root + block - 1 drafts).
        accept_len, commit_lens, bonus, out_tokens, new_seq_lens = worker._accept_block(
            candidates=candidates[:, :block].clone(), next_token_logits=logits,
            sampling_info=None, draft_input=None, prefix_lens=prefix.to(torch.int64), bs=bs,
        )  # fmt: skip
        moved_hidden = worker._committed_target_hidden(hidden)
        round_facts.update(
            out_tokens_shape=list(out_tokens.shape),
            hidden_shape=list(moved_hidden.shape),
            commit_lens=commit_lens.tolist(),
            accept_len=accept_len.tolist(),
            bonus=bonus.tolist(),
            walk_bonus=walk.bonus.tolist(),
            new_seq_lens=new_seq_lens.tolist(),
            tokens_ok=all(
                out_tokens[b, : int(commit_lens[b])].tolist()
                == expected_tokens[b, : int(commit_lens[b])].tolist()
                for b in range(bs)
            ),
            moves=allocator.moves,
            # What each window's front holds after the moves (slot ids: where its KV came
            # from), against the accepted nodes' slots; and every slot a move changed.
            window_fronts=[
                allocator.kv[window.view(bs, d)[b, : int(walk.accept_len[b])]].tolist()
                for b in range(bs)
            ],
            expected_fronts=[
                window.view(bs, d)[b, walk.accepted[b, : int(walk.accept_len[b])]].tolist()
                for b in range(bs)
            ],
            changed_slots=sorted(
                (allocator.kv != torch.arange(allocator.kv.numel())).nonzero().view(-1).tolist()
            ),
            front_slots=sorted(
                sum(
                    (window.view(bs, d)[b, : int(walk.accept_len[b])].tolist() for b in range(bs)),
                    [],
                )
            ),
            commit_kernel=commit_kernel_case(tree, target, prefix.to(torch.int64), window),
            window_move=window_move_case(walk, target, prefix.to(torch.int64), window),
            hidden_ok=all(
                torch.equal(moved_hidden[b * block + k], hidden[b * d + int(walk.accepted[b, k])])
                for b in range(bs)
                for k in range(int(walk.accept_len[b]))
            ),
        )
    else:
        from sglang.srt.speculative import eagle_utils

        eagle_utils.verify_tree_greedy_func = greedy_standin
        reqs = [FakeReq(100), FakeReq(100), FakeReq(2)]  # the third finishes after 2 tokens
        req_to_token = torch.zeros((4, 64), dtype=torch.int32)
        pool_rows = torch.tensor([2, 0, 3])
        batch = types.SimpleNamespace(
            forward_mode=types.SimpleNamespace(is_idle=lambda: False),
            batch_size=lambda: bs, sampling_info=None, reqs=reqs, device="cpu",
            out_cache_loc=window.clone(), token_to_kv_pool_allocator=allocator,
            req_pool_indices=pool_rows, req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
            seq_lens=prefix.clone(), seq_lens_cpu=prefix.clone(), seq_lens_sum=int(prefix.sum()),
        )  # fmt: skip
        logits_output = types.SimpleNamespace(next_token_logits=logits, hidden_states=hidden)
        bonus, commit_lens, next_hidden, num_correct = vi.verify(
            batch=batch, logits_output=logits_output, page_size=1
        )
        kept, expected_kv, expected_hidden = [], [], []
        for b in range(bs):
            n = int(commit_lens[b])
            rows = (walk.accepted[b, :n] + b * d).tolist()
            kept += rows
            expected_kv.append(window[rows].tolist())
            expected_hidden.append(hidden[rows])
        round_facts.update(
            commit_lens=commit_lens.tolist(),
            num_correct=num_correct,
            appended=[r.output_ids for r in reqs],
            expected_appended=[
                expected_tokens[b, : int(walk.accept_len[b])].tolist()[: reqs[b].max_new_tokens]
                for b in range(bs)
            ],
            bonus=bonus.tolist(),
            kv_rows=[
                req_to_token[
                    int(pool_rows[b]), int(prefix[b]) : int(prefix[b]) + int(commit_lens[b])
                ].tolist()
                for b in range(bs)
            ],
            expected_kv=expected_kv,
            freed=sorted(allocator.freed),
            expected_freed=sorted(set(window.tolist()) - set(window[kept].tolist())),
            seq_lens=batch.seq_lens.tolist(),
            seq_lens_cpu=batch.seq_lens_cpu.tolist(),
            seq_lens_sum=batch.seq_lens_sum,
            hidden_ok=torch.equal(next_hidden, torch.cat(expected_hidden)),
            verify_ct=[r.spec_verify_ct for r in reqs],
            correct_drafts=[r.spec_num_correct_drafts for r in reqs],
        )
    return round_facts


out["verify_round"] = verify_round(15)
if V2:
    out["kv_move_choice"] = kv_move_choice()
# a 64-node tree from a block-16 drafter: verify width 65
out["verify_round_64"] = verify_round(64)
if V2:
    out["verify_round_32"] = verify_round(32)

# --- who gets which width (0.5.13), with the arguments _handle_ddtree resolved for a
# block-16 drafter and budget 64: the draft runner is built with the drafter's block, the
# target's CUDA-graph capture dummy carries the width it captures, the scheduler reserves
# for the larger of draft block and verify tree.
if not V2:
    from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner  # noqa: E402
    from sglang.srt.server_args import set_global_server_args_for_scheduler  # noqa: E402
    from sglang.srt.speculative import dflash_worker  # noqa: E402

    widths = {}
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash  # noqa: E402

    for budget in (8, 64, "dflash"):  # DFLASH: unchanged, one width for both sides
        is_dflash = budget == "dflash"
        args = server_args(**{**base, "speculative_draft_model_path": f"{MODELS}/draft16",
                              "speculative_num_draft_tokens": None,
                              "speculative_algorithm": "DFLASH" if is_dflash else "DDTREE",
                              "speculative_ddtree_budget": None if is_dflash else budget})  # fmt: skip
        (_handle_dflash if is_dflash else _handle_ddtree)(args)
        algo_here = SpeculativeAlgorithm.from_string(args.speculative_algorithm)
        set_global_server_args_for_scheduler(args)
        seen = {}

        class _DraftRunnerBuilt(Exception):
            pass

        def record_draft_worker(*, server_args, is_draft_worker, seen=seen, **_):
            seen["draft_num_draft_tokens"] = server_args.speculative_num_draft_tokens
            seen["is_draft_worker"] = is_draft_worker
            raise _DraftRunnerBuilt

        dflash_worker.TpModelWorker = record_draft_worker
        target = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(
                mambaish_config=None, memory_pool_config=None,
                model_config=types.SimpleNamespace(context_len=4096),
            ),
            device="cpu", get_memory_pool=lambda: (None, None),
        )  # fmt: skip
        err = error_of(
            lambda args=args, target=target, chain=is_dflash: construct_v1_with(
                args, target, chain=chain
            )
        )
        seen["constructed_until"] = err
        seen["verify_width"] = args.speculative_num_draft_tokens
        runners = {}
        for role, run_args in () if is_dflash else (("target", args), ("draft", None)):
            runner = CudaGraphRunner.__new__(CudaGraphRunner)
            is_draft = role == "draft"
            runner.model_runner = types.SimpleNamespace(
                spec_algorithm=algo, is_draft_worker=is_draft, server_args=run_args
            )
            runner.num_tokens_per_bs = (
                args.speculative_dflash_block_size
                if is_draft
                else args.speculative_num_draft_tokens
            )
            runner.buffers = types.SimpleNamespace(custom_mask=torch.ones(4, dtype=torch.bool))
            info = runner.get_spec_info(runner.num_tokens_per_bs)
            runners[role] = [info.draft_token_num, info.custom_mask is not None]
        seen["capture_dummy"] = runners
        batch = ScheduleBatch.__new__(ScheduleBatch)
        batch.spec_algorithm = algo_here
        batch.reqs = [object()] * 3
        batch.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=1)
        seen["decode_reservation_3_reqs"] = batch.new_tokens_required_next_decode()
        widths[str(budget)] = seen
    out["widths"] = widths
    # arguments that did not go through _handle_ddtree: refused before any model loads
    out["tree_worker_unresolved"] = error_of(lambda: construct(TreeWorker, server_args(**base)))


# --- who gets which width (0.5.23), with the resolved arguments published the way SGLang's
# scheduler publishes them: each model runner's width comes through the algorithm's
# target-verify hook, and the verify window is budget + 1 slots from the committed prefix.
if V2:
    cache_locs = CACHE_LOCS
    from sglang.srt import runtime_context  # noqa: E402
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash  # noqa: E402
    from sglang.srt.speculative import dflash_info  # noqa: E402

    WORKER_HAS_KV_PLAN = "kv_loc_plan" in {
        f.name for f in dataclasses.fields(dflash_info.DFlashVerifyInput)
    }
    if WORKER_HAS_KV_PLAN:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator  # noqa: E402
    from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
    from sglang.srt.speculative import ddtree_worker_v2  # noqa: E402
    from sglang.srt.speculative.spec_info import create_dummy_verify_input  # noqa: E402

    def cache_locs_interpreted(*, req_pool_indices, req_to_token, start_offset, end_offset,
                               batch_size, draft_token_num, device):  # fmt: skip
        """assign_extend_cache_locs_func's GPU branch: SGLang's Triton kernel, run by the
        interpreter (the function has no branch for a CPU build without sgl_kernel)."""
        loc = torch.empty((batch_size * draft_token_num,), dtype=torch.int64)
        kernel = (
            cache_locs.assign_extend_cache_locs
            if out["cache_locs_kernel_error"] is None
            else CacheLocsTranscribed()
        )
        kernel[(batch_size,)](
            req_pool_indices, req_to_token, start_offset, end_offset, loc,
            req_to_token.shape[1], cache_locs.next_power_of_2(batch_size),
        )  # fmt: skip
        return loc

    ddtree_worker_v2.assign_extend_cache_locs_func = cache_locs_interpreted
    widths = {}
    for budget in (15, 64, "dflash"):  # DFLASH: unchanged, one width for both sides
        is_dflash = budget == "dflash"
        args = server_args(**{**block16, "speculative_algorithm": "DFLASH" if is_dflash else "DDTREE",
                              "speculative_ddtree_budget": None if is_dflash else budget})  # fmt: skip
        (_handle_dflash if is_dflash else _handle_ddtree)(args)
        if hasattr(runtime_context, "publish"):  # 0.5.17 on
            runtime_context.publish(args, role="scheduler")
            spec_config = runtime_context.get_spec()
        else:  # 0.5.14 - 0.5.16: the process-wide server arguments
            from sglang.srt.server_args import set_global_server_args_for_scheduler

            set_global_server_args_for_scheduler(args)
            spec_config = args
        algo_here = SpeculativeAlgorithm.from_string(resolved(args, "speculative_algorithm"))
        seen = {
            "spec_num_draft_tokens": spec_config.speculative_num_draft_tokens,
            "max_draft_tokens": (
                runtime_context.max_speculative_num_draft_tokens()
                if SEPARATE_RESOLUTION
                else max_draft_tokens_of(args)
            ),
        }
        dummy_takes_args = "server_args" in inspect.signature(create_dummy_verify_input).parameters
        for role, is_draft in (("target", False), ("draft", True)):
            runner = types.SimpleNamespace(
                spec_algorithm=algo_here, is_draft_worker=is_draft, server_args=args
            )
            if hasattr(ModelRunner, "decode_num_tokens_per_req"):  # 0.5.16 on
                per_req = ModelRunner.decode_num_tokens_per_req(runner)
            else:
                per_req = algo_here.get_num_tokens_per_bs_for_target_verify(
                    args.speculative_num_draft_tokens, is_draft
                )
            mask = torch.ones(4, dtype=torch.bool)
            dummy = (
                create_dummy_verify_input(algo_here, args, mask, per_req, is_draft)
                if dummy_takes_args
                else create_dummy_verify_input(algo_here, mask, per_req, is_draft)
            )
            seen[role] = [per_req, dummy.draft_token_num, dummy.custom_mask is not None]
        if not is_dflash:
            width, block = int(budget) + 1, 16
            req_to_token = torch.arange(4 * 200, dtype=torch.int32).view(4, 200) + 1000
            # The KV index plan, where the release's worker has one (0.5.22 on).
            translator = KVIndexTranslator(
                req_to_token=req_to_token, page_size=1, device="cpu",
                token_to_kv_pool_allocator=types.SimpleNamespace(page_size=1),
                token_to_kv_pool=object(),
            ) if WORKER_HAS_KV_PLAN else None  # fmt: skip
            pool_rows, prefix = torch.tensor([2, 0, 3]), torch.tensor([4, 9, 0])
            block_loc = cache_locs_interpreted(
                req_pool_indices=pool_rows, req_to_token=req_to_token, start_offset=prefix,
                end_offset=prefix + block, batch_size=3, draft_token_num=block, device="cpu",
            )  # fmt: skip
            block_plan = translator.plan(
                req_pool_indices=pool_rows, seq_lens=prefix, seq_lens_cpu=prefix.clone(),
                write_virtual=block_loc, read_extent=block,
            ) if translator is not None else None  # fmt: skip
            worker = TreeWorker.__new__(TreeWorker)
            worker.block_size, worker.verify_width, worker.device = block, width, "cpu"
            worker.model_runner = types.SimpleNamespace(
                req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token)
            )
            runner_attrs = {} if translator is None else {"kv_index_translator": translator}
            worker._target_worker = types.SimpleNamespace(
                model_runner=types.SimpleNamespace(**runner_attrs)
            )
            plan, loc = worker._verify_window(
                batch=types.SimpleNamespace(req_pool_indices=pool_rows), prefix_lens=prefix,
                kv_loc_plan=block_plan, verify_out_cache_loc=block_loc,
            )  # fmt: skip
            expected = [req_to_token[r, p : p + width].tolist()
                        for r, p in zip(pool_rows.tolist(), prefix.tolist(), strict=True)]  # fmt: skip
            seen["window"] = {
                "own_window": loc is not block_loc,
                "slots_ok": loc.view(3, width).tolist() == expected,
                "block_leads_it": torch.equal(loc.view(3, width)[:, :block].reshape(-1), block_loc),
                "kv_plan": None if translator is None else {
                    "own": plan is not block_plan,
                    "writes_ok": torch.equal(plan.write_ids(translator), loc),
                    "read_extent": plan.read_extent,
                    "block_plan_kept": torch.equal(block_plan.write_ids(translator), block_loc),
                },
            }  # fmt: skip
        widths[str(budget)] = seen
    out["widths"] = widths


# --- the draft head: top-K log-probs of the target's LM head at the drafted positions,
# against log_softmax + topk over the same vocabulary (stand-in head: weight + shard_indices)
from sglang.srt.speculative.ddtree_utils import draft_topk_logprobs  # noqa: E402


def draft_head_case(num_org, padded, added, added_start, k, chunk_size):
    hidden_size, bs, n_pos = 16, 3, 15
    weight = torch.randn(padded + added, hidden_size, generator=gen)
    head = types.SimpleNamespace(
        weight=weight,
        shard_indices=types.SimpleNamespace(
            num_org_elements=num_org, num_org_elements_padded=padded,
            num_added_elements=added, org_vocab_start_index=0,
            added_vocab_start_index=added_start,
        ),
    )  # fmt: skip
    hidden = torch.randn(bs, n_pos, hidden_size, generator=gen)
    lp, ids = draft_topk_logprobs(hidden, head, k, None, chunk_size=chunk_size)
    rows = torch.cat([weight[:num_org], weight[padded : padded + added]])
    row_ids = torch.cat([torch.arange(num_org), added_start + torch.arange(added)])
    ref = torch.log_softmax(hidden @ rows.T, dim=-1)
    want_lp, want_pos = ref.topk(min(k, rows.shape[0]), dim=-1)
    return {
        "shape": list(lp.shape),
        "ids_equal": bool(torch.equal(ids, row_ids[want_pos])),
        "max_logprob_error": float((lp - want_lp).abs().max()),
    }


def stand_in_head():
    """A one-part vocab-parallel head (50 tokens, hidden 16) for the warm-up and graphs."""
    return types.SimpleNamespace(
        weight=torch.randn(50, 16, generator=gen),
        shard_indices=types.SimpleNamespace(
            num_org_elements=50, num_org_elements_padded=50, num_added_elements=0,
            org_vocab_start_index=0, added_vocab_start_index=50,
        ),
    )  # fmt: skip


out["draft_head"] = {
    # one part: the direct path; 45 rows in chunks of 16 (three chunks, the last short)
    "one_part": draft_head_case(50, 50, 0, 0, k=8, chunk_size=16),
    # an added vocabulary: two parts, merged
    "added_vocab": draft_head_case(40, 48, 6, 48, k=8, chunk_size=16),
}

# --- the v1 worker's start-up warm-up of the round's eager part (head, tree, verify
# inputs, auto's statistics) per budget and batch size, here on CPU with a stand-in head
if not V2:
    from sglang.srt.speculative import ddtree_budget_policy as _policy  # noqa: E402
    from sglang.srt.speculative.ddtree_worker import candidate_tensors  # noqa: E402

    def warm_case(budget, capture_bs, auto):
        head = stand_in_head()
        worker = object.__new__(TreeWorker)
        runner = types.SimpleNamespace(
            model=types.SimpleNamespace(lm_head=head), device="cpu",
            graph_runner=types.SimpleNamespace(capture_bs=capture_bs) if capture_bs else None,
        )  # fmt: skip
        worker.target_worker = types.SimpleNamespace(model_runner=runner)
        worker.block_size, worker.budget, worker.tp_rank = 16, budget, 0
        worker.policy = _policy.BudgetPolicy(_policy.candidate_budgets(16)) if auto else None
        if auto:
            worker._candidates = candidate_tensors(worker.policy.budgets, "cpu")
        try:
            return [list(x) for x in worker._warm_eager_kernels(None)]
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    out["warm"] = {
        "fixed": warm_case(15, None, False),
        "auto": warm_case(64, [1, 2, 4], True),
    }

# --- the round graphs (ddtree_round_graphs.py): which graph a round replays, the copy into
# its input rows and the cut of its outputs, on the CPU. A stand-in for CUDA-graph capture
# keeps what real capture keeps (the outputs' buffers, written again by every replay): its
# replay runs the captured call on the graph's input buffer and copies the result in.
from sglang.srt.speculative.ddtree_round_graphs import (  # noqa: E402
    DraftRoundGraphs,
    RoundGraphsError,
)

_TREE_FIELDS = ("tokens", "parents", "depths", "visibility", "num_nodes", "scores")


def _round_tensors(result):
    logprobs, ids, tree = result
    return [logprobs, ids] + [getattr(tree, f) for f in _TREE_FIELDS]


def _capture_by_call(fn, pool):
    out = fn()

    def replay():
        for dst, src in zip(_round_tensors(out), _round_tensors(fn()), strict=True):
            dst.copy_(src)

    return replay, out


def round_graphs_for(head, capture_fn):
    return DraftRoundGraphs(
        lambda hidden, k: draft_topk_logprobs(hidden, head, k, None),
        ddtree_tree.build_tree_from_topk,
        sizes=[4, 2], n_pos=15, hidden_size=16, dtype=torch.float32, device="cpu",
        capture_fn=capture_fn, pool_fn=lambda: None,
    )  # fmt: skip


def round_graphs_failing(head):
    """The second capture fails (as a CUDA op that cannot be captured would): every graph
    is dropped and the rounds run eagerly."""
    calls = []

    def capture_fn(fn, pool):
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        return _capture_by_call(fn, pool)

    graphs = round_graphs_for(head, capture_fn)
    try:
        graphs.capture(8, 8)
        error = None
    except RoundGraphsError as exc:
        error = str(exc)
    hidden = torch.randn(2, 15, 16, generator=gen)
    got, want = graphs(hidden, 8, 8), graphs.eager_round(hidden, 8, 8)
    equal = all(torch.equal(a, b) for a, b in
                zip(_round_tensors(got), _round_tensors(want), strict=True))  # fmt: skip
    return {"error": error, "snapshot": graphs.snapshot(), "equal": equal}


def round_graphs_case():
    head = stand_in_head()
    graphs = round_graphs_for(head, _capture_by_call)
    captured = [graphs.capture(8, 8), graphs.capture(8, 8), graphs.capture(8, 4)]
    rounds = []
    # a captured size, a size padded to 4 (rows past 3 hold the previous round's), a size
    # padded to 2, one above every size and a (K, budget) never captured: eager
    for bs, k, budget in ((4, 8, 8), (3, 8, 8), (1, 8, 4), (5, 8, 8), (2, 6, 6)):
        hidden = torch.randn(bs, 15, 16, generator=gen) * 3
        got = graphs(hidden, k, budget)
        want = graphs.eager_round(hidden, k, budget)
        rounds.append({
            "bs": bs,
            "rows": [int(t.shape[0]) for t in _round_tensors(got)],
            "equal": all(torch.equal(a, b) for a, b in zip(
                _round_tensors(got), _round_tensors(want), strict=True)),
        })  # fmt: skip
    return {
        "captured": captured,
        "rounds": rounds,
        "snapshot": graphs.snapshot(),
        "failed": round_graphs_failing(head),
        "valid_after_capture": round_graphs_valid_after_capture(head),
    }


def _capture_unset(fn, pool):
    """A stand-in for capture that, as CUDA capture does, leaves the outputs unwritten (here:
    filled with -7) until the graph is replayed."""
    replay, out = _capture_by_call(fn, pool)
    for t in _round_tensors(out):
        t.fill_(-7)
    return replay, out


def round_graphs_valid_after_capture(head) -> bool:
    """Right after capture each graph's outputs hold the round of its (zero) input rows, not
    what capture left there: the v2 step graphs run once on them when they are captured."""
    graphs = round_graphs_for(head, _capture_unset)
    graphs.capture(8, 8)
    want = graphs.eager_round(torch.zeros(4, 15, 16), 8, 8)[2]
    size, tree = graphs.captured_trees(8, 8)[-1]
    return size == 4 and all(torch.equal(getattr(tree, f), getattr(want, f)) for f in _TREE_FIELDS)


out["round_graphs"] = round_graphs_case()


def round_graphs_switch():
    """``round_graphs_requested`` per value of its environment variable, under each
    default; and the warnings it logs."""
    import logging
    import os

    from sglang.srt.speculative import ddtree_round_graphs as rg

    saved = os.environ.pop(rg.ENV, None)
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    rg.logger.addHandler(handler)
    try:
        got = {}
        for value in (None, "", "1", "ON", " yes ", "0", "off", "False", "maybe"):
            if value is None:
                os.environ.pop(rg.ENV, None)
            else:
                os.environ[rg.ENV] = value
            got[repr(value)] = [rg.round_graphs_requested(d) for d in (False, True)]
        return {"requested": got, "warned": warned}
    finally:
        rg.logger.removeHandler(handler)
        os.environ.pop(rg.ENV, None)
        if saved is not None:
            os.environ[rg.ENV] = saved


out["round_graphs"]["switch"] = round_graphs_switch()
if not V2:
    # The v1 worker captures them only on one CUDA rank: here (CPU) it declines.
    worker = object.__new__(TreeWorker)
    worker.target_worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(
            model=types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=torch.zeros(4, 2))),
            device="cpu", graph_runner=None,
        )
    )  # fmt: skip
    worker.tp_rank = 0
    worker.block_size, worker.budget, worker.policy = 16, 15, None
    out["round_graphs"]["worker_on_cpu"] = worker._capture_round_graphs(None) is None
    out["round_graphs"]["worker_default"] = TreeWorker.ROUND_GRAPHS_DEFAULT
    # Told it is on CUDA where there is none: the capture fails and it serves without them.
    worker.target_worker.model_runner.device = "cuda"
    worker.target_worker.model_runner.model.lm_head = stand_in_head()
    out["round_graphs"]["worker_capture_fails"] = worker._capture_round_graphs(None) is None

if V2:
    # The v2 worker: its start-up warm-up (head, tree, verify inputs at its budget per
    # target CUDA-graph batch size), its capture declining on the CPU and failing on a
    # "CUDA" device that is not there, and its draft head replaying a captured round.
    import sglang.srt.speculative.ddtree_worker_v2 as _worker_v2  # noqa: E402

    _worker_v2.get_parallel = lambda: types.SimpleNamespace(tp_group=None, tp_rank=0)

    def v2_worker(head, capture_bs):
        worker = object.__new__(TreeWorker)
        runner = types.SimpleNamespace(model=types.SimpleNamespace(lm_head=head), device="cpu")
        if capture_bs is not None:
            runner.decode_cuda_graph_runner = types.SimpleNamespace(capture_bs=capture_bs)
        worker._target_worker = types.SimpleNamespace(model_runner=runner)
        worker.block_size, worker.budget, worker.topk = 16, 15, 15
        return worker

    head = stand_in_head()
    v2 = {
        "warm_graphs": [list(x) for x in v2_worker(head, [4, 1, 2])._warm_eager_kernels(None)],
        "warm_eager": [list(x) for x in v2_worker(head, None)._warm_eager_kernels(None)],
        "capture_on_cpu": v2_worker(head, [1])._capture_round_graphs(None) is None,
    }
    worker = v2_worker(head, [1])
    worker.target_worker.model_runner.device = "cuda"
    v2["capture_fails"] = worker._capture_round_graphs(None) is None
    v2["worker_default"] = TreeWorker.ROUND_GRAPHS_DEFAULT
    # A round of 3 replays the size-4 graph (rows past 3 hold another round's); a round
    # with another head object runs eagerly. Both give the eager round's tree.
    worker = v2_worker(head, [2, 4])
    worker._round_graphs = round_graphs_for(head, _capture_by_call)
    worker._round_graphs.capture(15, 15)
    worker._round_graphs_head = head
    replay = []
    for bs, lm_head in ((3, head), (4, head), (3, types.SimpleNamespace(**vars(head)))):
        draft_hidden = torch.randn(bs, 16, 16, generator=gen) * 3
        tokens = worker._draft_next_tokens(draft_hidden=draft_hidden, lm_head=lm_head, bs=bs)
        logprobs, ids = draft_topk_logprobs(draft_hidden[:, 1:, :], head, 15, None)
        want = ddtree_tree.build_tree_from_topk(logprobs, ids, 15)
        replay.append({
            "bs": bs,
            "tokens": list(tokens.shape),
            "equal": torch.equal(tokens, want.tokens[:, :15]) and all(
                torch.equal(getattr(worker._tree, f), getattr(want, f)) for f in _TREE_FIELDS),
        })  # fmt: skip
    v2["replay"] = replay
    v2["snapshot"] = worker._round_graphs.snapshot()
    # init_cuda_graphs, as the scheduler calls it (DFlash's own part stood in for: it
    # captures the drafter's graphs on a GPU): DFlash's first, then the opt-in capture
    # (declined on the CPU), then the warm-up. What it logs is what an operator reads.
    import logging  # noqa: E402
    import os  # noqa: E402

    class _Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = _Lines()
    loggers = [logging.getLogger(n) for n in (_worker_v2.__name__, "sglang.srt.speculative."
                                              "ddtree_round_graphs")]  # fmt: skip
    for lg in loggers:
        lg.addHandler(lines)
        lg.setLevel(logging.INFO)
    chain_init = ChainWorker.init_cuda_graphs
    ChainWorker.init_cuda_graphs = lambda self: lines.lines.append("dflash init_cuda_graphs")
    os.environ["SGLANG_DDTREE_ROUND_GRAPHS"] = "1"
    try:
        worker = v2_worker(head, [1, 2])
        worker.init_cuda_graphs()
        v2["init_lines"] = [line.split(" in ")[0] for line in lines.lines]
        v2["init_graphs"] = worker._round_graphs is None
    finally:
        ChainWorker.init_cuda_graphs = chain_init
        del os.environ["SGLANG_DDTREE_ROUND_GRAPHS"]
        for lg in loggers:
            lg.removeHandler(lines)
    out["round_graphs"]["v2"] = v2

    # The v2 step graphs (ddtree_step_graphs_v2.py): a worker whose rounds replay the round
    # graphs and then the verify-input and accept graphs of the same size, against a twin
    # that runs the same rounds eagerly, each with its own KV stand-in. The worker captures
    # them itself (_capture_step_graphs, the verify inputs' switched on), through a stand-in
    # for capture that keeps real capture's static buffers (its replay runs the captured
    # call and copies the outputs in), so the copy into the first rows, the cleared rows
    # past them, the shared mask buffer and the cut outputs are what is checked.
    import os  # noqa: E402

    from sglang.srt.speculative import ddtree_step_graphs_v2 as _step  # noqa: E402

    def _capture_step_by_call(fn, pool):
        first = fn()

        def replay():
            for dst, src in zip(first, fn(), strict=True):
                dst.copy_(src)

        return replay, first

    def step_worker(
        with_graphs: bool,
        capture_fn=_capture_step_by_call,
        verify_env="1",
        clobber=False,
        context_len=None,
    ):
        from sglang.srt.speculative.ddtree_round_timing import RoundTiming

        worker = v2_worker(head, [2, 4])
        worker.verify_width, worker.round_timing = 16, RoundTiming()
        allocator = FakeAllocator(slots=1024)
        runner = worker.target_worker.model_runner
        runner.token_to_kv_pool_allocator, runner.max_total_num_tokens = allocator, 400
        if context_len is not None:
            runner.model_config = types.SimpleNamespace(context_len=context_len)
        if with_graphs:
            worker._round_graphs = round_graphs_for(head, _capture_by_call)
            worker._round_graphs.capture(15, 15)
            worker._round_graphs_head = head
            if clobber:
                # what replaying another graph of the shared pool may leave in these buffers
                for _, _, graph_out in worker._round_graphs._graphs.values():
                    for t in _round_tensors(graph_out):
                        t.fill_(-7)
            saved = _step.cuda_capture, _step.cuda_pool
            _step.cuda_capture, _step.cuda_pool = capture_fn, lambda: None
            if verify_env is not None:
                os.environ[_step.VERIFY_ENV] = verify_env
            try:
                worker._capture_step_graphs(None)
            finally:
                _step.cuda_capture, _step.cuda_pool = saved
                os.environ.pop(_step.VERIFY_ENV, None)
        return worker, allocator

    def step_round(worker, r, bs, draft_hidden, window, prefix):
        """One round's build, verify input and accept as DFlash's round calls them."""
        drafts = worker._draft_next_tokens(draft_hidden=draft_hidden, lm_head=head, bs=bs)
        size = worker._round_size  # the round graph's size (None: eager), until the round ends
        roots = torch.arange(bs, dtype=torch.int64) + 7 * r
        block = torch.cat([roots.view(bs, 1), drafts], dim=1)
        batch = types.SimpleNamespace(seq_lens_cpu=prefix.clone(), out_cache_loc=window.clone())
        vi = worker._make_verify_input(
            batch=batch, draft_tokens=block, positions=None, prefix_lens=prefix.clone(),
            kv_loc_plan=None, verify_out_cache_loc=None,
        )  # fmt: skip
        verify = [vi.draft_token.clone(), vi.positions.clone(), vi.custom_mask.clone()]
        tree = worker._tree
        # the target follows each tree's deepest path for a part of it
        target = torch.randint(0, 50, (bs, 16), generator=torch.Generator().manual_seed(r))
        for b in range(bs):
            node = int(torch.argmax(tree.depths[b]))
            while node > 0:
                parent = int(tree.parents[b, node])
                if (node + r) % 3:
                    target[b, parent] = tree.tokens[b, node - 1]
                node = parent
        logits = torch.full((bs * 16, 50), -10.0)
        logits[torch.arange(bs * 16), target.reshape(-1)] = 10.0
        got = worker._accept_block(
            candidates=None, next_token_logits=logits, sampling_info=None,
            draft_input=None, prefix_lens=prefix.clone(), bs=bs,
        )  # fmt: skip
        rows = worker._accept_rows
        worker._committed_target_hidden(torch.zeros(bs * 16, 2))
        return size, verify, [*got, rows], worker._round_size

    def step_graphs_case() -> dict:
        graphed, kv_graphed = step_worker(True)
        eager, kv_eager = step_worker(False)
        rounds, held = [], []
        # 4, 4 and 3 replay size 4 (the accept's two slots in turn: the round of 3 replays
        # the first round's accept graph, whose fourth row held that round's inputs until
        # the graph cleared them), 1 and 2 size 2, the round of 2 with prefixes whose mask
        # does not fit the shared buffer (its verify inputs eager); 5 is above every size
        for r, (bs, most) in enumerate(((4, 60), (4, 60), (3, 60), (1, 60), (2, 300), (5, 60))):
            draft_hidden = torch.randn(bs, 16, 16, generator=gen) * 3
            window = torch.arange(100 + 100 * r, 100 + 100 * r + bs * 16, dtype=torch.int64)
            prefix = torch.randint(most - 50, most, (bs,), generator=gen)
            (size, v_graph, graph_out, after), (_, v_eager, eager_out, _) = (
                step_round(w, r, bs, draft_hidden, window, prefix) for w in (graphed, eager)
            )
            rounds.append({
                "bs": bs,
                "size": size,
                "size_after": after,
                "verify_equal": all(
                    torch.equal(a, b) for a, b in zip(v_graph, v_eager, strict=True)),
                "rows": [int(t.shape[0]) for t in graph_out],
                "equal": all(torch.equal(a, b) for a, b in zip(graph_out, eager_out, strict=True)),
                "kv_equal": torch.equal(kv_graphed.kv, kv_eager.kv),
                "targets_equal": sorted(kv_graphed.targets) == sorted(kv_eager.targets),
                "moved": int((kv_eager.kv != torch.arange(1024)).sum()),
            })  # fmt: skip
            # the previous round's outputs, which the scheduler still reads, are unchanged
            if held:
                prev, copies = held.pop()
                rounds[-2]["kept"] = all(
                    torch.equal(a, b) for a, b in zip(prev, copies, strict=True)
                )
            held.append((graph_out, [t.clone() for t in graph_out]))
        calls = []

        def failing(fn, pool):
            calls.append(fn)
            if len(calls) == 3:
                raise RuntimeError("operation not permitted when stream is capturing")
            return _capture_step_by_call(fn, pool)

        failed, _ = step_worker(True, failing)
        return {
            "rounds": rounds,
            "accept": graphed._accept_graphs.snapshot(),
            "verify": graphed._verify_graphs.snapshot(),
            "mask_numel": int(graphed._verify_mask.numel()),
            "state_keys": sorted(graphed.ddtree_internal_state()),
            "failed": {
                "accept": failed._accept_graphs is None,
                "verify": None
                if failed._verify_graphs is None
                else failed._verify_graphs.snapshot(),
            },
            # without SGLANG_DDTREE_VERIFY_GRAPHS (both on), and with it off
            "default": [
                g is not None
                for g in (lambda w: (w._accept_graphs, w._verify_graphs))(
                    step_worker(True, verify_env=None)[0]
                )
            ],
            "verify_off": [
                g is not None
                for g in (lambda w: (w._accept_graphs, w._verify_graphs))(
                    step_worker(True, verify_env="0")[0]
                )
            ],
            "clobbered": clobbered_case(),
            "mask_numel_context": mask_numel_with_context(30),
            "mask_numel_long_context": mask_numel_with_context(4000),
        }

    def mask_numel_with_context(context_len: int) -> int:
        """The shared mask buffer of a worker whose model's context length is known: room for
        the largest size's requests at that length, or the pool's tokens if fewer."""
        return int(step_worker(True, context_len=context_len)[0]._verify_mask.numel())

    def clobbered_case() -> dict:
        """Round graphs whose tree buffers another graph's replay wrote over before the step
        graphs' capture: the capture replays each size's round graph first, so the steps
        capture on (and run once on) the size's real tree."""
        worker, _ = step_worker(True, clobber=True)
        graphs = worker._round_graphs
        valid = []
        for (_size, k, budget), (static, _, graph_out) in sorted(graphs._graphs.items()):
            want = graphs.eager_round(static, k, budget)[2]
            valid.append(
                all(torch.equal(getattr(graph_out[2], f), getattr(want, f)) for f in _TREE_FIELDS)
            )
        return {
            "accept": worker._accept_graphs is not None,
            "verify": worker._verify_graphs is not None,
            "trees_valid": valid,
        }

    out["step_graphs"] = step_graphs_case()

    # The v2 worker's round timing, and what it hands the scheduler's get_internal_state.
    # DFlash's own round is stood in for (on a GPU it runs the draft block forward and the
    # target verify): for a decode batch it calls the worker's build seams as the real round
    # does (_draft_next_tokens, _make_verify_input, _committed_target_hidden) on CPU
    # tensors; prefill and idle batches it only answers.
    from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
    from sglang.srt.speculative.ddtree_round_timing import RoundTiming  # noqa: E402

    def v2_timed_rounds(with_graphs: bool) -> dict:
        worker = v2_worker(head, [2, 4])
        worker.verify_width, worker._accept_rows = 16, None  # as __init__ sets them
        worker.round_timing = RoundTiming()
        if with_graphs:
            worker._round_graphs = round_graphs_for(head, _capture_by_call)
            worker._round_graphs.capture(15, 15)
            worker._round_graphs_head = head
        passed, mask_sizes = [], []

        def dflash_round(self, batch, *args, **kwargs):
            passed.append([batch.forward_mode.name, list(args), sorted(kwargs)])
            mode = batch.forward_mode
            if mode.is_extend() or batch.is_extend_in_batch or mode.is_idle():
                return f"{mode.name.lower()} round"
            bs = batch.batch_size()
            draft_hidden = torch.randn(bs, 16, 16, generator=gen)
            drafts = self._draft_next_tokens(draft_hidden=draft_hidden, lm_head=head, bs=bs)
            block = torch.cat([torch.zeros((bs, 1), dtype=drafts.dtype), drafts], dim=1)
            # The batch's host lengths here are 3 more than the device's (an upper bound is
            # all a mask size needs): the mask's size says which of the two sized it.
            verify = self._make_verify_input(
                batch=batch, draft_tokens=block, positions=None,
                prefix_lens=torch.full((bs,), 8, dtype=torch.int64), kv_loc_plan=None,
                verify_out_cache_loc=None,
            )  # fmt: skip
            mask_sizes.append([verify.custom_mask.numel(), bs * 16 * (11 + 16)])
            self._committed_target_hidden(torch.zeros(bs * 16, 8))
            return f"decode round of {bs}"

        def batch(mode, bs, extend_in_batch=False):
            # ScheduleBatch's extend_num_tokens: 7 a request when this rank extends, None
            # when it decodes (also while another DP rank extends)
            return types.SimpleNamespace(
                forward_mode=mode, is_extend_in_batch=extend_in_batch, batch_size=lambda: bs,
                seq_lens_cpu=torch.full((bs,), 11, dtype=torch.int64),
                extend_num_tokens=7 * bs if mode == ForwardMode.EXTEND else None,
            )  # fmt: skip

        rounds = [
            (batch(ForwardMode.EXTEND, 3), {}),
            (batch(ForwardMode.DECODE, 3), {"on_publish": None}),
            (batch(ForwardMode.DECODE, 4), {}),
            (batch(ForwardMode.IDLE, 0), {}),
            (batch(ForwardMode.DECODE, 2, extend_in_batch=True), {}),  # another DP rank extends
            (batch(ForwardMode.DECODE, 1), {}),
            (batch(ForwardMode.DECODE, 5), {"grammar_barrier": None}),
        ]
        saved = ChainWorker.forward_batch_generation
        ChainWorker.forward_batch_generation = dflash_round
        try:
            results = [worker.forward_batch_generation(b, **kw) for b, kw in rounds]
        finally:
            ChainWorker.forward_batch_generation = saved
        state = worker.ddtree_internal_state()
        from_scheduler = scheduler_ddtree_state(worker)
        # Another algorithm's scheduler adds nothing, nor one that holds no draft worker.
        dflash_scheduler = scheduler_ddtree_state(worker, SpeculativeAlgorithm.DFLASH)
        timing = state["speculative_ddtree_round_timing"]
        return {
            "results": results,
            "passed": passed,
            "mask_sizes": mask_sizes,
            "state_keys": sorted(state),
            "timing": timing,
            "build_within_forward": all(
                cell["build_ms"]["max"] <= cell["forward_ms"]["max"] and cell["build_ms"]["max"] > 0
                for widths in timing["buckets"].values()
                for cell in widths.values()
            ),
            "round_graphs": state.get("speculative_ddtree_round_graphs"),
            "scheduler_where": from_scheduler["where"],
            "scheduler_state_keys": sorted(from_scheduler["state"]),
            "scheduler_timing_equal": from_scheduler["state"].get("speculative_ddtree_round_timing")
            == worker.round_timing.snapshot(),
            "dflash_scheduler": dflash_scheduler["state"],
            "no_draft_worker": scheduler_ddtree_state(None)["state"],
        }

    out["round_timing_v2"] = {"eager": v2_timed_rounds(False), "graphs": v2_timed_rounds(True)}

# --- request validation (a stand-in request: validation reads two attributes)
from sglang.srt.speculative.ddtree_utils import validate_ddtree_request  # noqa: E402


def request(**params):
    fields = {"json_schema": None, "regex": None, "ebnf": None, "structural_tag": None}
    return types.SimpleNamespace(
        return_logprob=params.pop("return_logprob", False),
        sampling_params=types.SimpleNamespace(**{**fields, **params}),
    )


out["validate"] = {
    "plain": validate_ddtree_request(request()),
    "logprob": validate_ddtree_request(request(return_logprob=True)),
    "regex": validate_ddtree_request(request(regex="a+")),
    "json_schema": validate_ddtree_request(request(json_schema="{}")),
}

# --- budget auto's policy settings from SGLANG_DDTREE_BUDGET_POLICY (v1 only: v2 refuses
# auto)
if not V2:
    from sglang.srt.speculative.ddtree_worker import budget_policy_config  # noqa: E402

    def policy_env_case(budget, text) -> dict:
        args = server_args(**{**base, "speculative_ddtree_budget": budget})
        with environ(SGLANG_DDTREE_BUDGET_POLICY=text):
            try:
                config = budget_policy_config(args)
            except ValueError as exc:
                return {"error": f"ValueError: {exc}"}
        return {"changed": None if config is None else config.changed()}

    out["budget_policy_env"] = {
        name: policy_env_case(budget, text)
        for name, budget, text in [
            ("unset", "auto", None),
            ("set", "auto", "hysteresis=0.02, min_dwell=64"),
            ("unknown", "auto", "hysterisis=0.02"),
            ("not_an_int", "auto", "min_dwell=0.5"),
            ("out_of_range", "auto", "hysteresis=-1"),
            ("fixed_budget", 15, "hysteresis=0.02"),
            ("fixed_budget_unset", 15, None),
        ]
    }

# --- spec_need_hidden_states (v2 reads the published spec config or the server
# arguments, by release; give it DDTREE's)
if V2:
    from sglang.srt.speculative import spec_utils  # noqa: E402

    ddtree_spec = types.SimpleNamespace(
        speculative_algorithm="DDTREE", enable_multi_layer_eagle=False
    )
    if "server_args" in inspect.signature(spec_utils.spec_need_hidden_states).parameters:
        out["spec_need_hidden_states"] = spec_utils.spec_need_hidden_states(ddtree_spec)
    else:
        spec_utils.get_spec = lambda: ddtree_spec
        out["spec_need_hidden_states"] = spec_utils.spec_need_hidden_states()

print(json.dumps(out))
