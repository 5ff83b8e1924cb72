"""DDTree's budget per decode round: the candidate that commits the most tokens per second.

``--budget auto`` lets the running batch pick DDTree's node budget ``B`` each round among a
few candidates. For a batch of ``b`` requests the policy maximises

    expected committed tokens per second = b * (1 + a(B)) / cost(bucket(b), B + 1)

where ``a(B)`` is the expected number of drafted tokens a request accepts per round at budget
``B`` and ``cost`` the measured time of a round of that batch bucket at verify width
``B + 1``. The choice never changes what is generated: verification is lossless at any
budget (at temperature 0 every budget commits the target's greedy tokens).

Expected acceptance. A tree's value, the sum of its nodes' path probabilities under the
draft, is the expected number of accepted drafted tokens if the target's tokens followed the
draft. The best-first tree is a prefix order: the budget-``B`` tree is the ``B`` best nodes
of any larger budget's tree, so one tree at the largest candidate gives every candidate's
value (the sum of its ``B`` largest path probabilities), and a round verified at budget
``B`` also says what every smaller candidate ``B'`` would have accepted (the accepted path's
nodes among the ``B'`` best). Drafters are not calibrated, so acceptance is the value times
a ratio learned from the rounds: for the smallest candidate ``a(B0) = r * v(B0)``, ``v`` a
running mean of the value per request and ``r`` the ratio of accepted drafted tokens to
predicted value over every round (every tree holds the smallest one). A larger candidate
adds to the one below it what its extra nodes add: ``a(Bi) = a(Bi-1) + g(Bi) * (v(Bi) -
v(Bi-1))``, ``g(Bi)`` the ratio of the extra accepted tokens to the extra value, measured on
the same rounds (those at ``Bi`` or above, each giving both trees' counts). Paired so, the
difference between two budgets does not depend on which requests each happened to run on:
requests differ far more from each other (a prompt that repeats itself accepts every
drafted token, another two in fifteen) than two trees on the same round do. Per-budget
ratios, each over the rounds its budget ran, did depend on it: on an H100 (patched SGLang
0.5.13, the 8B-cost pair) a bucket that ran 15 while 32 ran a few re-timing rounds had
15's ratio at 1.155 and 32's at 1.048, expected 15 to accept more than 32 from its larger
ratio, and kept 15 where a budget-32 server was 7 % faster. A larger candidate than the one
in use only learns on its occasional rounds, and a ratio from a few rounds is noisy (a lucky
one would win the choice, then regress), so each added ratio is shrunk towards the next
smaller candidate's (the smallest's ``r`` for the first) with the weight of
``calibration_prior`` request-rounds of its mean added value: with few rounds of its own a
budget's extra nodes are taken to be calibrated like those below them, with many they have
their own ratio. Ratios have a long memory (``calibration_decay``) so that they do not
follow each request's difficulty; the values carry that: when the draft grows less sure,
every candidate's value drops, including those of budgets not run lately.

Cost, per (batch bucket, width); buckets are powers of two. Each bucket starts by running
every candidate until it has ``min_samples`` timed rounds after ``warmup_samples`` untimed
ones (exploration, the candidates in turn so that a change of load hits them alike; first
use of a shape pays for allocations, graph capture, compiles; a round the caller reports
untimed, such as a capture, does not count). From then on a round's time is modelled as a
level (what a round at the narrowest width costs now) times the width's time relative to
it: rounds at the budget in use move the level, and now and then the least recently timed
other candidate runs and moves its relative time, measured against the level of that
moment: after ``first_reexplore`` rounds, then twice as long each time up to every
``reexplore_every`` rounds (a choice made on few samples is checked soon). A re-timing
runs two rounds in a row and times the second: the first round at a width after rounds at
another can cost more than the width does (caches, a graph not replayed lately), and a
single round timed so makes every width but the one in use look dearer. On the H200
(patched SGLang 0.5.13, the 8B-cost pair) single re-timing rounds took 0.5-1.3 ms more, of
10-14, than the same width's rounds on a fixed-budget server (part of it the servers'
host speed), and a bucket kept a budget that a fixed one beat by 8 %. A width far off
the budget in use waits longer for its turn: ``(r_in_use / ((1 + hysteresis) * r_width))
** 2`` times the gap, at most ``retime_stretch`` times (a re-timing is worth its cost when
it could change the choice, and a far-off width's costs most: on the H200 at bucket 32
widths 33 and 65 cost 1.6 and 2.8 times width 16, and their re-timings and exploration
took 5 % of the bucket's time in a five-trial bench); the expected rates move with every
round's values, so a width that comes near is re-timed on the usual schedule again. The
choice depends on relative times only, so a machine that gets busier or quieter (other
jobs, a longer context) moves every candidate's cost together instead of making the
budget in use look worse than candidates timed long ago. Both, and the exploration's cost
per width, are robust means of recent samples (``level_window``, ``relative_window``:
the mean of those within a factor 1.5 of their median): a single slow round (a CUDA
graph's first replay, an allocation, another process's burst) must not set a width's cost.
With means it did: on the H200 one re-timing round, by the mean's jump some 30 times the
usual, made a width look 6 times dearer for the next few hundred rounds. A bucket changes
its budget only when another candidate beats the current one by more than ``hysteresis``,
and runs a budget wider than the smallest candidate (the drafter's block - 1, DFlash's
verify width) only while it is expected to beat the smallest by more than ``hysteresis``:
from the end of the exploration on, the smallest is the default, and a wider budget whose
lead shrinks to the hysteresis or less gives way to it. The expected rates leave out what
happens between rounds (the scheduler's work, prefills), and a small expected lead of a
wider budget proved not to be one: on an H100 (patched SGLang 0.5.13, the 8B-cost pair)
a bucket chose 32 at the policy's 33rd round on a 5.2 % lead over 15, kept it by the
hysteresis when the lead had shrunk to 2.6 %, and the server was 2.6 % slower than a
budget-15 server in a ten-trial bench at that load. A bucket goes back to the budget it
left only ``min_dwell`` of its rounds after leaving it: with a wider budget's lead near the
hysteresis the estimates cross it back and forth, and on the same H100 with this rule a
bucket whose 32 was expected 4.4-5.6 % ahead of 15 changed its budget 13 times in 560
rounds of the policy, twice on consecutive rounds. Other changes are not held back: while
the calibration learns that a wide tree's values overpromise, a bucket moves 64 -> 32 -> 15
in a few dozen rounds, and a dwell on every change would hold each step 128 rounds. Every
change is logged (``logging``, logger ``ddtree.budget``) and kept in :meth:`snapshot`.

Values of budgets above the round's are only known on rounds that build the largest tree:
the policy asks for such a probe every ``probe_every`` rounds (and until every value is
known), and the value means are taken over those rounds only, the same rounds for every
candidate (a mean of small-budget values over all rounds would be biased against the rounds
at which a larger budget happens to run). A probe below the largest budget costs a round
more than its own width does (the wider top-K, the second tree, their launches), so such a
round's time says nothing about its width: ``observe`` leaves it untimed, and the rounds
the policy times (``Plan.timed``: exploration and re-timing) are never such probes, a probe
due then waiting for the next round. On the H200 the probes' extra time, left in, made
the widths it re-timed look 1-2 ms dearer (of 10-15) than the same widths' rounds on
fixed-budget servers, and a bucket kept a budget that a fixed budget beat by 5-10 %.

Pure Python, standard library only (no torch, no engine): the embedded engine and a serving
worker call it the same way::

    plan = policy.plan(batch)                 # Plan(budget, probe, timed)
    ... run the round at plan.budget (and, if plan.probe, read the largest tree's values)
    policy.observe(batch, plan.budget, seconds=..., values={B: sum over rows},
                   accepted={B: drafted tokens accepted, sum over rows})

or, where every round's time is known at once but the trees' statistics cost work to
read (a serving worker on a GPU), ``observe_time`` every round and ``observe_stats`` on
the rounds whose statistics it reads (every probe, and some others for the calibration).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

AUTO = "auto"

log = logging.getLogger("ddtree.budget")


def parse_budget(text: str | int) -> int | str:
    """``"auto"`` or a budget of at least 1; ValueError with a one-line reason otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip()
        if raw.lower() == AUTO:
            return AUTO
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"must be a positive integer or 'auto', got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


class BudgetOptionError(ValueError):
    """A bad ``--budget``/``--max-budget`` pair; ``option`` is the one at fault
    (``"budget"`` or ``"max_budget"``)."""

    def __init__(self, message: str, option: str):
        super().__init__(message)
        self.option = option


CLI_NAMES = {"budget": "--budget", "max_budget": "--max-budget", "block_size": "--block-size"}


def budget_options(
    budget: str | int | None,
    max_budget: int | None,
    block_size: int | None = None,
    names: Mapping[str, str] = CLI_NAMES,
) -> int | str | None:
    """``--budget`` (None, a number of at least 1, or "auto") and ``--max-budget`` (only with
    "auto"; at least 1 and, with a known ``block_size``, at least block - 1), as ``ddtree
    serve`` and ``ddtree bench`` take them: the parsed budget, or BudgetOptionError with the
    one-line reason, naming the options as ``names`` does (a deploy file has its own)."""
    b, m, k = names["budget"], names["max_budget"], names["block_size"]
    if budget is not None:
        try:
            budget = parse_budget(budget)
        except ValueError as exc:
            raise BudgetOptionError(f"{b} {exc}", "budget") from None
    if max_budget is not None:
        if max_budget < 1:
            raise BudgetOptionError(f"{m} must be at least 1, got {max_budget}", "max_budget")
        if budget != AUTO:
            raise BudgetOptionError(f"{m} applies to {b} auto only", "max_budget")
        if block_size is not None and max_budget < block_size - 1:
            raise BudgetOptionError(
                f"{m} {max_budget} is below {k} - 1 ({block_size - 1}), which {b} auto "
                "always keeps",
                "max_budget",
            )
    return budget


def candidate_budgets(block_size: int, max_budget: int | None = None) -> tuple[int, ...]:
    """The budgets ``auto`` chooses among: the drafter's ``block - 1`` (where the tree holds at
    least the chain's probability mass, so DDTree is never behind DFlash's proposal), then
    ``2 * block``, ``4 * block``, ... up to ``max_budget`` (default ``4 * block``), and
    ``max_budget`` itself."""
    if block_size < 2:
        raise ValueError(f"block size {block_size} must be at least 2")
    base = block_size - 1
    top = 4 * block_size if max_budget is None else int(max_budget)
    if top < base:
        raise ValueError(
            f"max budget {top} is below the drafter's block - 1 ({base}), which auto always keeps"
        )
    budgets = {base, top}
    step = 2 * block_size
    while step < top:
        budgets.add(step)
        step *= 2
    return tuple(sorted(budgets))


def batch_bucket(batch: int) -> int:
    """The power of two at or above ``batch``: rounds of 3 and 4 requests share a cost."""
    if batch < 1:
        raise ValueError(f"batch {batch} must be at least 1")
    return 1 << (batch - 1).bit_length()


@dataclass(frozen=True)
class PolicyConfig:
    min_samples: int = 5  # timed rounds per (bucket, width) before its cost is trusted
    warmup_samples: int = 2  # first rounds per (bucket, width), run but not timed
    hysteresis: float = 0.05  # switch only to a candidate > 5 % better than the current one
    min_dwell: int = 128  # a bucket's rounds before it may go back to the budget it left
    level_window: int = 32  # rounds at the budget in use that set the level (robust mean)
    relative_window: int = 16  # timings of a width that set its relative time (robust mean)
    value_weight: float = 0.05  # the same for a request's tree value
    calibration_decay: float = 0.998  # per round at a budget: the ratio's memory, ~500 rounds
    calibration_prior: float = 16.0  # request-rounds of the smaller budget's ratio in each
    probe_every: int = 32  # rounds between reads of every candidate's value
    first_reexplore: int = 16  # rounds of a bucket before its first re-timing of another width
    reexplore_every: int = 256  # ... and the most between two, the gap doubling up to it
    retime_stretch: float = 4.0  # the most a far-off width's wait between re-timings grows
    history: int = 32  # budget changes kept for snapshot()

    @classmethod
    def from_text(cls, text: str) -> PolicyConfig:
        """Settings as ``name=value`` pairs separated by commas (``"hysteresis=0.02,
        min_dwell=64"``: a serving worker's ``SGLANG_DDTREE_BUDGET_POLICY``), the others at
        their defaults; "" gives the defaults. ValueError with a one-line reason for an
        unknown name, a value of the wrong kind or one out of range."""
        kinds = {f.name: type(f.default) for f in fields(cls)}
        settings = {}
        for item in (x.strip() for x in text.split(",")):
            if not item:
                continue
            name, sep, raw = (x.strip() for x in item.partition("="))
            if not sep or name not in kinds:
                raise ValueError(
                    f"unknown budget policy setting {item!r} (known: {', '.join(kinds)})"
                )
            try:
                settings[name] = kinds[name](raw)
            except ValueError:
                what = "whole number" if kinds[name] is int else "number"
                raise ValueError(
                    f"budget policy setting {name} takes a {what}, got {raw!r}"
                ) from None
        return cls(**settings)

    def changed(self) -> dict:
        """The settings that differ from the defaults (what :meth:`from_text` was given)."""
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }

    def __post_init__(self):
        if self.min_samples < 1 or self.warmup_samples < 0:
            raise ValueError("min_samples must be >= 1 and warmup_samples >= 0")
        if min(self.level_window, self.relative_window) < 1:
            raise ValueError("level_window and relative_window must be >= 1")
        if self.hysteresis < 0:
            raise ValueError("hysteresis must be >= 0")
        if self.min_dwell < 1:
            raise ValueError("min_dwell must be >= 1")
        if not 0 < self.value_weight <= 1:
            raise ValueError("value_weight must be in (0, 1]")
        if not 0 < self.calibration_decay <= 1:
            raise ValueError("calibration_decay must be in (0, 1]")
        if self.calibration_prior < 0:
            raise ValueError("calibration_prior must be >= 0")
        if min(self.probe_every, self.first_reexplore, self.reexplore_every) < 1:
            raise ValueError("probe_every, first_reexplore and reexplore_every must be >= 1")
        if self.retime_stretch < 1:
            raise ValueError("retime_stretch must be >= 1")


@dataclass(frozen=True)
class Plan:
    budget: int  # the budget to verify this round
    probe: bool  # also read every candidate's value (build the largest tree)
    timed: bool = False  # an exploration or re-timing round: its time is wanted


class _Mean:
    """A running mean for the first 1/weight samples, then an exponentially weighted one."""

    __slots__ = ("n", "value", "weight")

    def __init__(self, weight: float, value: float = 0.0, n: int = 0):
        self.n, self.value, self.weight = n, value, weight

    def add(self, x: float) -> None:
        self.n += 1
        self.value += (x - self.value) * max(1.0 / self.n, self.weight)


def robust_mean(samples: Iterable[float]) -> float:
    """The mean of the samples within a factor 1.5 of their (lower) median. One slow round
    (a CUDA graph's first replay, an allocation, another process's burst) does not move it;
    ordinary noise averages out as in a mean."""
    ordered = sorted(samples)
    median = ordered[(len(ordered) - 1) // 2]  # a sample, so ``kept`` holds at least it
    kept = [x for x in ordered if median / 1.5 <= x <= median * 1.5]
    return sum(kept) / len(kept)


class _Window:
    """The robust mean of the last ``size`` samples: a lasting change moves it within half
    a window. Computed once per new sample (a choice reads it for every candidate)."""

    __slots__ = ("_value", "samples")

    def __init__(self, size: int, values: Iterable[float] = ()):
        self.samples: deque[float] = deque(values, maxlen=size)
        self._value: float | None = None

    def add(self, x: float) -> None:
        self.samples.append(x)
        self._value = None

    @property
    def value(self) -> float:
        if self._value is None:
            self._value = robust_mean(self.samples)
        return self._value


@dataclass
class _Ratio:
    """Decayed sums of accepted drafted tokens and of predicted value."""

    accepted: float = 0.0
    predicted: float = 0.0
    rounds: int = 0

    def add(self, accepted: float, predicted: float, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.predicted = self.predicted * decay + predicted
        self.rounds += 1

    @property
    def ratio(self) -> float | None:
        return self.accepted / self.predicted if self.predicted > 0 else None


@dataclass
class _Bucket:
    """Round times of one batch bucket: while exploring, the robust mean per width; then a
    level (the narrowest width's round time now) times each width's time relative to it,
    each the robust mean of a window of recent samples."""

    budget: int | None = None  # the choice in use (None while exploring)
    rounds: int = 0
    left: int | None = None  # the budget the last change left (None: no change yet)
    changed_at: int = 0  # ``rounds`` at that change
    since_reexplore: int = 0
    retimings: int = 0
    seen: dict[int, int] = field(default_factory=dict)  # width -> rounds run (timed or not)
    timed: dict[int, int] = field(default_factory=dict)  # width -> timed rounds
    samples: dict[int, list[float]] = field(default_factory=dict)  # exploring: width -> s
    level: _Window | None = None
    relative: dict[int, _Window] = field(default_factory=dict)
    last_timed: dict[int, int] = field(default_factory=dict)  # width -> round index
    retime: int | None = None  # a re-timing's budget, its timed round still to plan
    warm: int | None = None  # the width whose next observed round is a re-timing's first

    def cost(self, width: int) -> float | None:
        if self.level is not None:
            return self.level.value * self.relative[width].value
        samples = self.samples.get(width)
        return robust_mean(samples) if samples else None

    def add_time(self, width: int, seconds: float) -> None:
        self.timed[width] = self.timed.get(width, 0) + 1
        self.last_timed[width] = self.rounds
        if self.level is None:
            self.samples.setdefault(width, []).append(seconds)
        elif self.budget is not None and width == self.budget + 1:
            self.level.add(seconds / self.relative[width].value)
        else:  # a re-timing: compared with the level of the same moment
            self.relative[width].add(seconds / self.level.value)

    def settle(self, widths: Iterable[int], level_window: int, relative_window: int) -> None:
        """End of exploration: from per-width samples to a level (the narrowest width's) and
        relative times (each sample over the narrowest width's median)."""
        widths = sorted(widths)
        first = self.samples[widths[0]]
        ref = robust_mean(first)
        self.level = _Window(level_window, first)
        self.relative = {
            w: _Window(relative_window, (x / ref for x in self.samples[w])) for w in widths
        }


class BudgetPolicy:
    """Chooses a budget per round for a batch; see the module docstring.

    Thread-safe: one thread plans and observes, others may call :meth:`snapshot`.
    """

    def __init__(self, budgets: Iterable[int], config: PolicyConfig | None = None):
        self.budgets = tuple(sorted({int(b) for b in budgets}))
        if not self.budgets or self.budgets[0] < 1:
            raise ValueError(f"candidate budgets must be positive, got {self.budgets}")
        self.config = config or PolicyConfig()
        self._lock = threading.Lock()
        self._buckets: dict[int, _Bucket] = {}
        self._values = {b: _Mean(self.config.value_weight) for b in self.budgets}
        # Per candidate, on the rounds that verified it or a larger budget: the accepted
        # tokens and the value its tree adds to the next smaller candidate's (the smallest:
        # its whole tree's).
        self._added = {b: _Ratio() for b in self.budgets}
        self._estimates: dict | None = None  # _acceptances(), until the next statistics
        self._rounds = 0
        self._probe_due = False  # a probe that a timed round put off
        self._changes: deque[dict] = deque(maxlen=self.config.history)
        self._num_changes = 0

    @property
    def max_budget(self) -> int:
        return self.budgets[-1]

    # ---- the two calls of a round ----------------------------------------------------

    def plan(self, batch: int) -> Plan:
        """The budget for this round of ``batch`` requests, and whether to probe values."""
        cfg = self.config
        with self._lock:
            key = batch_bucket(batch)
            state = self._buckets.setdefault(key, _Bucket())
            state.rounds += 1
            self._rounds += 1
            probe = (
                self._probe_due
                or (self._rounds - 1) % cfg.probe_every == 0
                or any(self._values[b].n == 0 for b in self.budgets)
            )
            if state.retime is not None:  # a re-timing's second round: the one timed
                budget, state.retime = state.retime, None
                return self._timed_plan(budget, probe)
            exploring = [b for b in self.budgets if not self._timed_enough(state, b)]
            if exploring:  # the least run first, then the smallest
                return self._timed_plan(
                    min(exploring, key=lambda b: (state.seen.get(b + 1, 0), b)), probe
                )
            if state.budget is None:
                self._choose(key, state)
            state.since_reexplore += 1
            gap = min(cfg.reexplore_every, cfg.first_reexplore << min(state.retimings, 30))
            if state.since_reexplore >= gap and len(self.budgets) > 1:
                state.since_reexplore = 0
                state.retimings += 1
                stalest = self._due_retiming(key, state, gap)
                if stalest is not None:
                    # Two rounds in a row: the first pays for the switch and is not timed
                    # (a probe due rides on it), the second is.
                    state.retime, state.warm = stalest, stalest + 1
                    self._probe_due = False
                    return Plan(stalest, probe, timed=True)
            self._probe_due = False
            return Plan(state.budget, probe)

    def _timed_plan(self, budget: int, probe: bool) -> Plan:
        """A round whose time the policy wants: a probe at the largest budget is free (its
        tree is the largest), one below it waits for the next round."""
        free = budget == self.budgets[-1]
        self._probe_due = probe and not free
        return Plan(budget, probe and free, timed=True)

    def observe(
        self,
        batch: int,
        budget: int,
        *,
        seconds: float | None,
        values: Mapping[int, float],
        accepted: Mapping[int, float],
    ) -> None:
        """Record a round of ``batch`` requests at ``budget``: :meth:`observe_time` and
        :meth:`observe_stats` of the same round.

        ``seconds``: the round's time, None when it is not representative (a capture, a
        compile); a probe below the largest budget (``values`` beyond ``budget``) and the
        first round of a re-timing are taken as untimed here. Rounds are reported in the
        order they ran; every ``Plan.timed`` round must be (one lost costs a sample).
        ``values``: per candidate budget, the sum over the batch of its tree's value; must
        hold ``budget`` itself (the verified tree's value) and may hold others (all of them
        on a probe round). ``accepted``: per candidate budget up to ``budget``, the drafted
        tokens its tree would have accepted (committed tokens minus one per request, summed
        over the batch); must hold ``budget``, each with its value.
        """
        self._check_stats(budget, values, accepted)
        self.observe_time(batch, budget, seconds, wide=any(b > budget for b in values))
        self._record_stats(batch, values, accepted)

    def observe_time(
        self, batch: int, budget: int, seconds: float | None, *, wide: bool = False
    ) -> None:
        """A round's time alone, for a caller that knows every round's time at once but
        reads the trees' statistics on some rounds only (a serving worker: its host time is
        free, the statistics cost launches): every round, in the order they ran, each at
        most once. ``wide``: the round also built the largest tree (a probe below the
        largest budget), so it is dearer than its width and taken as untimed, as is the
        first round of a re-timing. A time that ends the bucket's exploration, or that
        re-times a width other than the one in use, makes a choice; the budget in use's
        rounds only move the level, and the next :meth:`observe_stats` chooses with it."""
        if budget not in self._values:
            raise ValueError(f"budget {budget} is not a candidate ({self.budgets})")
        cfg = self.config
        with self._lock:
            key = batch_bucket(batch)
            state = self._buckets.setdefault(key, _Bucket())
            width = budget + 1
            if wide:
                seconds = None
            if state.warm == width:  # a re-timing's first round: it pays for the switch
                state.warm, seconds = None, None
            seen = state.seen.get(width, 0)
            state.seen[width] = seen + 1
            if seconds is None or seconds <= 0 or seen < cfg.warmup_samples:
                return
            state.add_time(width, seconds)
            if state.level is None:
                if self._explored(state):
                    state.settle(
                        (b + 1 for b in self.budgets), cfg.level_window, cfg.relative_window
                    )
                    self._choose(key, state)
            elif budget != state.budget:
                self._choose(key, state)

    def observe_stats(
        self,
        batch: int,
        budget: int,
        *,
        values: Mapping[int, float],
        accepted: Mapping[int, float],
    ) -> None:
        """A round's tree statistics alone (``values`` and ``accepted`` as in
        :meth:`observe`), its time reported by :meth:`observe_time`; may come a round or
        more after it. Moves the value means and calibration ratios, then chooses."""
        self._check_stats(budget, values, accepted)
        self._record_stats(batch, values, accepted)

    def _record_stats(self, batch, values, accepted) -> None:
        cfg = self.config
        with self._lock:
            key = batch_bucket(batch)
            state = self._buckets.setdefault(key, _Bucket())
            # Only rounds that know every value update the means, so that the candidates'
            # means come from the same rounds (values of one round only grow with B).
            if all(b in values for b in self.budgets):
                for b in self.budgets:
                    self._values[b].add(values[b] / batch)
            below_accepted = below_value = 0.0
            for b in self.budgets:  # ``accepted``: the candidates up to the round's budget
                if b not in accepted:
                    break
                self._added[b].add(
                    accepted[b] - below_accepted, values[b] - below_value, cfg.calibration_decay
                )
                below_accepted, below_value = accepted[b], values[b]
            self._estimates = None
            if state.level is not None:
                self._choose(key, state)

    def _check_stats(self, budget, values, accepted) -> None:
        if budget not in self._values:
            raise ValueError(f"budget {budget} is not a candidate ({self.budgets})")
        if budget not in values or budget not in accepted:
            raise ValueError(f"values and accepted must hold the verified budget {budget}")
        if any(b not in values or b not in self._values for b in accepted):
            raise ValueError("every accepted count needs a candidate budget and its value")

    def observe_prefix(
        self,
        batch: int,
        budget: int,
        *,
        seconds: float | None,
        values: Sequence[float],
        accepted: Sequence[float],
        probe: Sequence[float] | None = None,
    ) -> None:
        """:meth:`observe` from a tree's statistics as lists (:meth:`prefix_stats`)."""
        self.observe(batch, budget, seconds=seconds, **self.prefix_stats(values, accepted, probe))

    def prefix_stats(
        self,
        values: Sequence[float],
        accepted: Sequence[float],
        probe: Sequence[float] | None = None,
    ) -> dict:
        """``values`` and ``accepted`` for :meth:`observe` or :meth:`observe_stats` from
        lists: those of the candidates up to the round's budget, smallest first (what a
        round's tree speaks for, the best-first tree being a prefix order), and ``probe``
        every candidate's value when the round also built the largest tree."""
        mine = self.budgets[: len(values)]
        known = dict(zip(self.budgets, probe, strict=True)) if probe is not None else {}
        known.update(zip(mine, values, strict=True))
        return {"values": known, "accepted": dict(zip(mine, accepted, strict=True))}

    # ---- estimates -------------------------------------------------------------------

    def calibration(self, budget: int) -> float:
        """Expected accepted / value for ``budget`` (1 before any round): the smallest
        candidate's own ratio; a larger one's ``a(B) / v(B)`` as :meth:`expected_acceptance`
        builds it, or, before any value is known, its added ratio chained from the
        smallest's."""
        ratio, acceptance = self._acceptances()[budget]
        value = self._values[budget]
        if acceptance is not None and value.value > 0:
            return acceptance / value.value
        return ratio

    def expected_acceptance(self, budget: int) -> float | None:
        """Calibrated expected drafted tokens accepted per request at ``budget``."""
        return self._acceptances()[budget][1]

    def _acceptances(self) -> dict[int, tuple[float, float | None]]:
        """Per candidate: (its ratio: the smallest's accepted / value, a larger one's added
        accepted / added value, shrunk towards the ratio below it; its expected acceptance
        per request, None before any value is known). See the module docstring. Kept until
        the next statistics change them (every candidate's rate reads them)."""
        if self._estimates is not None:
            return self._estimates
        known = self._values[self.budgets[0]].n > 0  # every candidate's mean, or none
        ratio, acceptance, below = 1.0, 0.0, 0.0
        out = {}
        for i, b in enumerate(self.budgets):
            added, own = self._values[b].value - below, self._added[b]
            prior = (
                self.config.calibration_prior * (max(added, 0.0) if known else 1.0) if i else 0.0
            )
            if own.predicted + prior > 0:
                ratio = (own.accepted + prior * ratio) / (own.predicted + prior)
            acceptance += ratio * max(added, 0.0)
            out[b] = (ratio, acceptance if known else None)
            below = self._values[b].value
        self._estimates = out
        return out

    def expected_rate(self, batch: int, budget: int) -> float | None:
        """Expected committed tokens per second for ``batch`` requests at ``budget``; None
        until both the value and the cost of that round are known."""
        state = self._buckets.get(batch_bucket(batch))
        cost = state.cost(budget + 1) if state else None
        acceptance = self.expected_acceptance(budget)
        if cost is None or cost <= 0 or acceptance is None:
            return None
        return batch * (1.0 + acceptance) / cost

    def budget_for(self, batch: int) -> int | None:
        """The budget in use for ``batch``'s bucket (None while it explores)."""
        state = self._buckets.get(batch_bucket(batch))
        return state.budget if state else None

    # ---- internals -------------------------------------------------------------------

    def retime_stretch(self, batch: int, budget: int) -> float:
        """How many times the usual gap ``budget`` waits between re-timings in ``batch``'s
        bucket: ``(r_in_use / ((1 + hysteresis) * r_budget)) ** 2`` from the expected rates,
        between 1 (a width within the hysteresis of the budget in use, or either rate
        unknown) and ``retime_stretch``."""
        state = self._buckets.get(batch_bucket(batch))
        if state is None or state.budget is None or budget == state.budget:
            return 1.0
        return self._stretch(
            self.expected_rate(batch, state.budget), self.expected_rate(batch, budget)
        )

    def _stretch(self, current: float | None, mine: float | None) -> float:
        if mine is None or current is None or mine <= 0:
            return 1.0
        far = (current / ((1 + self.config.hysteresis) * mine)) ** 2
        return min(self.config.retime_stretch, max(1.0, far))

    def _due_retiming(self, key: int, state: _Bucket, gap: int) -> int | None:
        """At a re-timing's turn: the least recently timed other candidate among those due,
        or None. A near one (stretch 1) is always due, as every stalest width was before
        stretches (its last timing can be a round short of ``gap`` ago: rounds are observed
        a round late); a far-off one once ``gap`` times its stretch rounds have passed."""
        current = self.expected_rate(key, state.budget)
        due = []
        for b in self.budgets:
            if b == state.budget:
                continue
            stretch = self._stretch(current, self.expected_rate(key, b))
            last = state.last_timed.get(b + 1, -1)
            if stretch <= 1.0 or state.rounds - last >= gap * stretch:
                due.append((last, b))
        return min(due)[1] if due else None

    def _timed_enough(self, state: _Bucket, budget: int) -> bool:
        # Untimed rounds (captures) past the warm-up extend the exploration.
        width = budget + 1
        return (
            state.seen.get(width, 0) >= self.config.warmup_samples
            and state.timed.get(width, 0) >= self.config.min_samples
        )

    def _explored(self, state: _Bucket) -> bool:
        return all(self._timed_enough(state, b) for b in self.budgets)

    def _choose(self, key: int, state: _Bucket) -> None:
        rates = {b: self.expected_rate(key, b) for b in self.budgets}
        known = {b: r for b, r in rates.items() if r is not None}
        if not known:
            if state.budget is None:
                state.budget = self.budgets[0]
            return
        best = max(known, key=lambda b: (known[b], -b))  # ties: the smaller budget
        base, margin = self.budgets[0], 1 + self.config.hysteresis
        # The smallest candidate (the drafter's block - 1: DFlash's verify width, a tree at
        # least as good as its chain) is the default: a wider one is run only while it is
        # expected to beat it by more than the hysteresis, from the first choice on (see
        # the module docstring: a small expected lead of a wider budget is not one).
        if best != base and base in known and known[best] <= known[base] * margin:
            best = base
        current = state.budget
        if best == current:
            return
        if best != base and current in known and known[best] <= known[current] * margin:
            return  # between wider candidates, the usual hysteresis
        if best == state.left and state.rounds - state.changed_at < self.config.min_dwell:
            return  # no going back within min_dwell rounds (see the module docstring)
        change = {
            "batch_bucket": key,
            "from": current,
            "to": best,
            "round": self._rounds,
            "tok_s": {str(b): round(r, 3) for b, r in known.items()},
        }
        self._changes.append(change)
        self._num_changes += 1
        state.budget, state.left, state.changed_at = best, current, state.rounds
        log.info(
            "DDTree budget for batch bucket %d: %s -> %d (expected tok/s %s)",
            key,
            current if current is not None else "exploring",
            best,
            ", ".join(f"B={b}: {r:.1f}" for b, r in sorted(known.items())),
        )

    # ---- reporting -------------------------------------------------------------------

    def snapshot(self) -> dict:
        """JSON-ready state: the budget in use per batch bucket with its estimates."""
        with self._lock:
            buckets = {}
            for key in sorted(self._buckets):
                state = self._buckets[key]
                rates = {b: self.expected_rate(key, b) for b in self.budgets}
                buckets[str(key)] = {
                    "budget": state.budget,
                    "rounds": state.rounds,
                    "round_ms": {
                        str(b): round(cost * 1e3, 4)
                        for b in self.budgets
                        if (cost := state.cost(b + 1)) is not None
                    },
                    "timed_rounds": {str(w - 1): n for w, n in sorted(state.timed.items())},
                    "expected_tok_s": {
                        str(b): None if r is None else round(r, 3) for b, r in rates.items()
                    },
                    "retime_stretch": {
                        str(b): round(self._stretch(rates.get(state.budget), r), 3)
                        for b, r in rates.items()
                        if b != state.budget
                    },
                }
            return {
                "candidates": list(self.budgets),
                "rounds": self._rounds,
                "buckets": buckets,
                "value_per_request": {
                    str(b): round(m.value, 4) if m.n else None for b, m in self._values.items()
                },
                "calibration": {str(b): round(self.calibration(b), 4) for b in self.budgets},
                "calibration_rounds": {str(b): r.rounds for b, r in self._added.items()},
                "added_calibration": {
                    str(b): round(ratio, 4)
                    for b, (ratio, _) in self._acceptances().items()
                    if b != self.budgets[0]
                },
                "budget_changes": self._num_changes,
                "recent_changes": list(self._changes),
                "config": self.config.changed(),
            }
