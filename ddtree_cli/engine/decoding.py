"""Batched AR, DFlash and DDTree decoding over the target's and drafter's caches.

Rows ``0..b-1`` of both caches belong to the active sequences, in order; a finished
sequence's row is refilled by the last row so the active batch is always a prefix of the
cache (slices, not gathers). Invariant per row: the target cache holds the prompt and every
committed token except the last one, the *root*, which the next round feeds first.

A round (one target forward for the whole batch):
  ar      root only; the target's token is committed.
  dflash  drafter block -> argmax chain of ``block_size - 1`` tokens; verify the chain under
          a causal mask; commit the matched prefix plus the target's token after it.
  ddtree  drafter block -> best-first tree under ``budget`` nodes (``draft_tree``); verify
          every node under its ancestor mask; walk; compact the accepted path's K/V to the
          front of the block; commit the path's target tokens. With ``budget="auto"`` a
          ``BudgetPolicy`` picks the round's budget among a few candidates for the running
          batch, from the trees' values and the measured round times; any budget commits
          the same tokens at temperature 0, so the choice changes speed, not output.
At temperature > 0 every verified position gets an independent sample from the target and
a draft is accepted only when it equals that sample, which keeps the output distribution
the target's own.

Everything after the drafter (the tree or chain, the verify forward, the walk, the KV
compaction, the drafter-context update, the new lengths and roots) stays on the device; the
round's one host synchronisation reads back the accept lengths and committed tokens, and
stop tokens and length limits are then applied on the host. On CUDA that verify phase is
captured once per (batch, span bucket) as a CUDA graph and replayed (greedy rounds; a
round with a sampled row runs eagerly), for every algorithm alike. The key span is rounded
up to a multiple of ``span_bucket`` so that few shapes occur; masks hide the extra columns.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ddtree_cli import draft_tree
from ddtree_cli.budget_policy import AUTO, BudgetPolicy, candidate_budgets
from ddtree_cli.engine.target import move_columns
from ddtree_cli.engine.weights import ModelPair
from ddtree_cli.errors import ConfigError

log = logging.getLogger("ddtree.engine")

DraftHook = Callable[[torch.Tensor, Sequence["RequestState"]], torch.Tensor]


@dataclass
class RequestState:
    """One request inside the engine."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    verify_ct: int = 0
    correct_drafts: int = 0
    # Tokens per round before truncation at a stop token or the length limit.
    accepted_tokens: int = 0
    # correct_drafts_histogram[k]: rounds that accepted k drafted tokens (SGLang's field).
    correct_drafts_histogram: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to a stop token or the length limit; return what was appended."""
        taken = []
        for tok in tokens:
            self.output.append(tok)
            taken.append(tok)
            if tok in self.stop_ids:
                self.finish_reason = {"type": "stop", "matched": tok}
                break
            if len(self.output) >= self.max_new_tokens:
                self.finish_reason = {"type": "length", "length": self.max_new_tokens}
                break
        return taken


class Engine:
    """Decoding state for up to ``max_batch`` sequences; one thread drives it.

    Moves the pair's modules to ``device``/``dtype`` in place (engines sharing a pair share
    its weights, so they must agree on both).
    """

    def __init__(
        self,
        pair: ModelPair,
        algo: str = "ar",
        *,
        block_size: int | None = None,
        budget: int | str | None = None,
        max_budget: int | None = None,
        max_batch: int = 8,
        context_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        span_bucket: int | None = None,
    ):
        if algo not in ("ar", "dflash", "ddtree"):
            raise ConfigError(f"unknown algorithm {algo!r}", hint="use ar, dflash or ddtree")
        self.algo = algo
        self.device = torch.device(device)
        self.dtype = dtype
        self.target = pair.target.to(self.device, dtype).eval()
        self.drafter = pair.drafter.to(self.device, dtype).eval()
        self.pair = pair
        self.block_size = block_size or pair.drafter.config.block_size
        if self.block_size < 2:
            raise ConfigError(f"block size {self.block_size} must be at least 2")
        self.draft_len = self.block_size - 1
        # ``budget``: DDTree's fixed node budget, or "auto" (a policy picks one of
        # ``budgets`` per round); ``width``: the widest verify, which sizes the buffers.
        self.budget = budget if budget is not None else self.draft_len
        self.policy = self._budget_policy(algo, max_budget)
        self.budgets = self.policy.budgets if self.policy else (self.budget,)
        if algo == "ddtree" and self.budgets[0] < 1:
            raise ConfigError(f"budget {self.budget} must be at least 1")
        self.width = {"ar": 1, "dflash": self.block_size, "ddtree": self.budgets[-1] + 1}[algo]
        self.max_batch = max_batch
        max_pos = pair.target.config.max_position_embeddings
        # Room for a verify block past the longest allowed sequence.
        headroom = self.width + self.block_size
        # The default leaves room for any verify up to 4 blocks wide (auto's default largest
        # budget), so that every algorithm of one pair reports the same context length, as
        # the servers of one model do; only a wider verify shrinks it.
        default = max_pos - self.block_size - max(self.width, 4 * self.block_size + 1)
        self.context_len = context_len if context_len is not None else default
        self.capacity = self.context_len + headroom
        if self.capacity > max_pos:
            raise ConfigError(
                f"context length {self.context_len} needs positions up to {self.capacity}, "
                f"the model has {max_pos}"
            )
        self.cache = self.target.new_cache(max_batch, self.capacity, self.device, dtype)
        self.draft_cache = (
            self.drafter.new_cache(max_batch, self.capacity, self.device, dtype)
            if algo != "ar"
            else None
        )
        self.feature_layers = tuple(pair.drafter.config.target_layer_ids) if algo != "ar" else ()
        self.lens = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.roots = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.temps = torch.zeros(max_batch, dtype=torch.float32, device=self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.seqs: list[RequestState] = []
        self.draft_hook: DraftHook | None = None
        # Lifetime counters over request-rounds (speculative modes): SGLang's definitions.
        self.total_rounds = 0
        self.total_accepted = 0
        self.mask_id = pair.drafter.config.mask_token_id
        self._arange = torch.arange(self.capacity + 1, device=self.device)
        self._rows = torch.arange(max_batch, device=self.device).unsqueeze(1)
        if algo == "ddtree":
            from ddtree_cli.engine import cpu_tree

            # Same trees and walks; on the CPU the scalar heap skips ~200 tiny tensor ops.
            self._tree = cpu_tree if self.device.type == "cpu" else draft_tree
            # The ancestor mask is one gather from [visible | visibility | hidden].
            n = self.width
            self._mask_edges = (
                torch.ones(max_batch, n, 1, dtype=torch.bool, device=self.device),
                torch.zeros(max_batch, n, 1, dtype=torch.bool, device=self.device),
            )
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ConfigError("CUDA graphs need a CUDA device", hint="drop cuda_graphs")
        if span_bucket is not None and span_bucket < 1:
            raise ConfigError(f"span bucket {span_bucket} must be at least 1")
        # Graphs need few distinct key spans; eager rounds attend over the exact span.
        self.span_bucket = span_bucket or (256 if self.cuda_graphs else 1)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.graph_error: str | None = None
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._captured = False
        # Per round budget: the candidates its tree speaks for (those not above it).
        self._budget_list = {
            b: [c for c in self.budgets if c <= b]
            for b in (self.budgets if self.policy is not None else ())
        }
        self._candidates = {
            b: torch.tensor(cands, device=self.device) for b, cands in self._budget_list.items()
        }

    def _budget_policy(self, algo: str, max_budget: int | None) -> BudgetPolicy | None:
        if self.budget != AUTO:
            if max_budget is not None:
                raise ConfigError("a max budget applies to budget 'auto' only")
            if not isinstance(self.budget, int):
                raise ConfigError(f"budget {self.budget!r} is neither a number nor 'auto'")
            return None
        if algo != "ddtree":
            raise ConfigError("budget 'auto' applies to ddtree only")
        try:
            return BudgetPolicy(candidate_budgets(self.block_size, max_budget))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    # ---- admission -------------------------------------------------------------------

    def check(self, seq: RequestState) -> None:
        """Raise ConfigError if ``seq`` can never run on this engine."""
        if not seq.prompt:
            raise ConfigError("empty prompt")
        if len(seq.prompt) + seq.max_new_tokens > self.context_len:
            raise ConfigError(
                f"prompt ({len(seq.prompt)}) + max_new_tokens ({seq.max_new_tokens}) exceeds "
                f"the context length {self.context_len}"
            )
        if seq.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")

    def add(self, seq: RequestState) -> list[int]:
        return self.add_many([seq])[0]

    @torch.inference_mode()
    def add_many(self, seqs: list[RequestState]) -> list[list[int]]:
        """Prefill ``seqs`` together (one padded causal forward) into the next free rows.

        Returns each sequence's first committed token (a list, empty never).
        """
        if len(self.seqs) + len(seqs) > self.max_batch:
            raise RuntimeError("engine is full")
        for seq in seqs:
            self.check(seq)
        first, k = len(self.seqs), len(seqs)
        rows = slice(first, first + k)
        width = max(len(s.prompt) for s in seqs)
        ids = torch.tensor(
            [s.prompt + [0] * (width - len(s.prompt)) for s in seqs], dtype=torch.long
        ).to(self.device)
        lens = torch.tensor([len(s.prompt) for s in seqs], dtype=torch.long).to(self.device)
        temps = torch.tensor([s.temperature for s in seqs], dtype=torch.float32).to(self.device)
        pos = self._arange[:width].unsqueeze(0).expand(k, width)
        # Causal, and blind to each row's padding (whose K/V lands past the row's length).
        mask = (pos.unsqueeze(-1) >= pos.unsqueeze(-2)) & (pos < lens.unsqueeze(1)).unsqueeze(1)
        hidden, feats = self.target(
            ids, pos, self.cache[:, :, rows], pos, mask.unsqueeze(1), self.feature_layers
        )
        last = hidden.gather(1, (lens - 1).view(k, 1, 1).expand(k, 1, hidden.shape[-1]))
        tokens = self._choose(self.target.logits(last), temps, any(s.temperature > 0 for s in seqs))
        if self.draft_cache is not None:
            self.drafter.write_context(self.draft_cache[:, :, rows], feats, pos, pos)
        self.lens[rows] = lens
        self.roots[rows] = tokens[:, 0]
        self.temps[rows] = temps
        self.seqs.extend(seqs)
        taken = [seq.commit([tok]) for seq, tok in zip(seqs, tokens[:, 0].tolist(), strict=True)]
        for row in reversed(range(first, first + k)):
            if self.seqs[row].finished:
                self._remove(row)
        return taken

    # ---- one round -------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[tuple[RequestState, list[int]]]:
        """One verify round for every active sequence; returns (sequence, new tokens)."""
        b = len(self.seqs)
        if b == 0:
            return []
        sampling = any(s.temperature > 0 for s in self.seqs)
        plan = self.policy.plan(b) if self.policy is not None else None
        budget = plan.budget if plan is not None else self.budget
        width = budget + 1 if self.algo == "ddtree" else self.width
        start = time.perf_counter()
        # Cache length of the longest row (its root is not in the cache yet).
        longest = max(len(s.prompt) + len(s.output) for s in self.seqs) - 1
        draft = self._draft_logits(b, longest) if self.algo != "ar" else None
        probe = None
        if plan is not None and plan.probe and budget < self.budgets[-1]:
            # Every candidate's value from one tree at the largest budget (a prefix order);
            # the policy takes such a round as untimed.
            probe = self._stats(self._tree.build_tree(draft, self.budgets[-1]), b)[0]
        span = min(self.capacity, -(-(longest + width) // self.span_bucket) * self.span_bucket)
        self._captured = False
        if self.cuda_graphs and not sampling:
            result, stats = self._replay(b, span, draft, budget)
        else:
            result, stats = self._verify(b, span, draft, sampling, budget)
        # The round's single host synchronisation.
        host = result.tolist()
        if plan is not None:
            seconds = None if self._captured else time.perf_counter() - start
            self._observe(b, budget, seconds, stats, probe)
        return self._commit(host)

    def _stats(self, tree, b: int, walk=None) -> torch.Tensor | list[list[float]]:
        """``_tree_values``; on the CPU in Python scalars (``cpu_tree.prefix_stats``: the
        dozen tiny tensor ops cost ~0.15 ms a round there, 1.3 % of the embedded pair's)."""
        if self.device.type != "cpu":
            return self._tree_values(tree, b, walk)
        from ddtree_cli.engine import cpu_tree

        return cpu_tree.prefix_stats(tree, walk, self._budget_list[tree.budget], b)

    def _tree_values(self, tree, b: int, walk=None) -> torch.Tensor:
        """Per candidate budget up to the tree's own, summed over the batch: the value of
        the budget-``B'`` tree and (given the verify ``walk``) the drafted tokens it would
        have accepted; [2, candidates] (``draft_tree.prefix_stats``)."""
        path = walk.accepted[:, 1:] if walk is not None else None
        return draft_tree.prefix_stats(
            tree.scores[:b], path, self._candidates[tree.budget], self._arange
        )

    def _observe(self, b, budget, seconds, stats, probe) -> None:
        values, accepted = stats.tolist() if isinstance(stats, torch.Tensor) else stats
        if isinstance(probe, torch.Tensor):
            probe = probe.tolist()
        self.policy.observe_prefix(
            b, budget, seconds=seconds, values=values, accepted=accepted, probe=probe
        )

    def _verify(
        self, b: int, span: int, draft: torch.Tensor | None, sampling: bool, budget: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Verify, accept, compact and advance rows 0..b-1 without leaving the device.

        Attends over cache columns ``< span``. Returns [b, 1 + W]: each row's accept length
        (tokens committed this round), then the committed tokens (only that many are valid);
        and, under a budget policy, the tree's statistics (``_stats``), else None.
        Reads and writes only tensors that live as long as the engine, so it can be captured.
        """
        stats = None
        lens, roots, temps = self.lens[:b], self.roots[:b], self.temps[:b]
        cache = self.cache[:, :, :b]
        if self.algo == "ar":
            pos = lens.unsqueeze(1)
            mask = (self._arange[:span] <= pos.unsqueeze(-1)).unsqueeze(1)
            hidden, _ = self.target(roots.unsqueeze(1), pos, cache, pos, mask)
            committed = self._choose(self.target.logits(hidden), temps, sampling)
            accept_len = torch.ones_like(lens)
            bonus = committed[:, 0]
        elif self.algo == "dflash":
            chain = draft.argmax(-1)
            ids = torch.cat([roots.unsqueeze(1), chain], dim=1)
            pos = lens.unsqueeze(1) + self._arange[: self.block_size]
            mask = (self._arange[:span] <= pos.unsqueeze(-1)).unsqueeze(1)
            hidden, feats = self.target(ids, pos, cache, pos, mask, self.feature_layers)
            committed = self._choose(self.target.logits(hidden), temps, sampling)
            matched = (chain == committed[:, :-1]).long().cumprod(dim=1)
            accept_len = 1 + matched.sum(dim=1)
            bonus = committed.gather(1, (accept_len - 1).unsqueeze(1)).squeeze(1)
            self.drafter.write_context(self.draft_cache[:, :, :b], feats, pos, pos)
        else:
            tree = self._tree.build_tree(draft, budget)
            committed, walk = self._verify_tree(b, span, tree, sampling)
            accept_len, bonus = walk.accept_len, walk.bonus
            if self.policy is not None:
                stats = self._stats(tree, b, walk)
        self.lens[:b] += accept_len
        self.roots[:b] = bonus
        return torch.cat([accept_len.unsqueeze(1), committed], dim=1), stats

    def _verify_tree(self, b, span, tree, sampling):
        lens, roots, temps = self.lens[:b], self.roots[:b], self.temps[:b]
        # verify_inputs() also builds SGLang's flat FULL_MASK and retrieve_* arrays, which
        # this engine does not need: its mask is the visibility block placed after each
        # row's prefix.
        n = tree.num_slots
        input_ids = torch.cat([roots.unsqueeze(1), tree.tokens], dim=1)
        positions = lens.unsqueeze(1) + tree.depths
        write = lens.unsqueeze(1) + self._arange[:n]
        # Cache column c of a row is its prefix (c < len: visible), tree node c - len, or
        # past the block (hidden): index [visible | visibility | hidden] by c - len + 1.
        visible, hidden_col = self._mask_edges
        extended = torch.cat([visible[:b, :n], tree.visibility, hidden_col[:b, :n]], dim=2)
        col = (self._arange[1 : span + 1] - lens.unsqueeze(1)).clamp_(0, n + 1)
        mask = extended.gather(2, col.unsqueeze(1).expand(b, n, span))
        cache = self.cache[:, :, :b]
        hidden, feats = self.target(
            input_ids, positions, cache, write, mask.unsqueeze(1), self.feature_layers
        )
        target_tokens = self._choose(self.target.logits(hidden), temps, sampling)
        walk = self._tree.verify_walk(tree, target_tokens)
        # A path holds at most n nodes, so columns past n of ``accepted`` are always -1.
        depth = min(walk.accepted.shape[1], n)
        path = walk.accepted[:, :depth].clamp(min=0)
        committed = target_tokens.gather(1, path)
        dst = write[:, :depth]
        # Entries past a row's accept length land beyond its new length: never attended.
        move_columns(self.cache, self._rows[:b], lens.unsqueeze(1) + path, dst)
        path_feats = feats.gather(1, path.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
        self.drafter.write_context(self.draft_cache[:, :, :b], path_feats, dst, dst)
        return committed, walk

    # ---- CUDA graphs -----------------------------------------------------------------

    def _replay(self, b: int, span: int, draft: torch.Tensor | None, budget: int):
        graph = self._graphs.get((b, span, budget))
        if graph is None:
            return self._capture(b, span, draft, budget)
        if draft is not None:
            graph.draft.copy_(draft)
        graph.graph.replay()
        return graph.result, graph.stats

    def _capture(self, b: int, span: int, draft: torch.Tensor | None, budget: int):
        """Run this round eagerly on a side stream (the capture's warm-up: lazy inits, Triton
        compilation), then capture the same work as a graph for the later rounds."""
        self._captured = True  # this round's time is not a round's cost
        static_draft = draft.clone() if draft is not None else None
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            result = self._verify(b, span, static_draft, False, budget)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
                static_result, static_stats = self._verify(b, span, static_draft, False, budget)
        except Exception as exc:  # keep serving, eagerly; say why once
            self.cuda_graphs = False
            self.graph_error = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, running eagerly: %s", self.graph_error)
            return result
        # Graphs share one memory pool; safe because they never run concurrently and each
        # result is read right after its own replay.
        self._graphs[(b, span, budget)] = _Graph(graph, static_draft, static_result, static_stats)
        return result

    def _draft_logits(self, b: int, longest: int) -> torch.Tensor:
        lens, roots = self.lens[:b], self.roots[:b]
        block = torch.full((b, self.block_size), self.mask_id, dtype=torch.long, device=self.device)
        block[:, 0] = roots
        pos = lens.unsqueeze(1) + self._arange[: self.block_size]
        hidden = self.drafter(
            self.target.embed(block), pos, self.draft_cache[:, :, :b], lens, longest
        )
        logits = self.target.logits(hidden[:, 1:])
        if self.draft_hook is not None:
            logits = self.draft_hook(logits, self.seqs)
        return logits

    def _choose(self, logits: torch.Tensor, temps: torch.Tensor, sampling: bool) -> torch.Tensor:
        """Target token per position: argmax, or an independent sample where temperature > 0."""
        greedy = logits.argmax(dim=-1)
        if not sampling:
            return greedy
        b, n, v = logits.shape
        scaled = logits.float() / temps.clamp(min=1e-5).view(b, 1, 1)
        probs = torch.softmax(scaled, dim=-1).view(b * n, v)
        drawn = torch.multinomial(probs, 1, generator=self.gen).view(b, n)
        return torch.where(temps.view(b, 1) > 0, drawn, greedy)

    # ---- bookkeeping -----------------------------------------------------------------

    def _commit(self, host: list[list[int]]) -> list[tuple[RequestState, list[int]]]:
        results = []
        for seq, row in zip(list(self.seqs), host, strict=True):
            n = row[0]
            if self.algo != "ar":
                seq.verify_ct += 1
                seq.correct_drafts += n - 1
                seq.accepted_tokens += n
                hist = seq.correct_drafts_histogram
                hist.extend([0] * (n - len(hist)))
                hist[n - 1] += 1
                self.total_rounds += 1
                self.total_accepted += n
            results.append((seq, seq.commit(row[1 : 1 + n])))
        for row in reversed(range(len(self.seqs))):
            if self.seqs[row].finished:
                self._remove(row)
        return results

    def drop(self, seq: RequestState) -> None:
        """Remove an unfinished sequence (its client went away)."""
        for row, active in enumerate(self.seqs):
            if active is seq:
                self._remove(row)
                return

    def _remove(self, row: int) -> None:
        last = len(self.seqs) - 1
        if row != last:
            moved = self.seqs[last]
            used = len(moved.prompt) + len(moved.output)
            self.cache[:, :, row, :used] = self.cache[:, :, last, :used]
            if self.draft_cache is not None:
                self.draft_cache[:, :, row, :used] = self.draft_cache[:, :, last, :used]
            for buf in (self.lens, self.roots, self.temps):
                buf[row] = buf[last]
            self.seqs[row] = moved
        self.seqs.pop()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    draft: torch.Tensor | None  # the captured input: this round's draft logits go here
    result: torch.Tensor  # [b, 1 + W], rewritten by every replay
    stats: torch.Tensor | None  # the tree's statistics under a budget policy, likewise


def generate(
    engine: Engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: frozenset[int] = frozenset(),
) -> list[RequestState]:
    """Run prompts to completion, at most ``engine.max_batch`` at a time (tests, benchmarks)."""
    pending = [RequestState(p, max_new_tokens, temperature, stop_ids) for p in prompts]
    queue = deque(pending)
    while queue or engine.seqs:
        admit = [
            queue.popleft() for _ in range(min(len(queue), engine.max_batch - len(engine.seqs)))
        ]
        if admit:
            engine.add_many(admit)
        engine.step()
    return pending
