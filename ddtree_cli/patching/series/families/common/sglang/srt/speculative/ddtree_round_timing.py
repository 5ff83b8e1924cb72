"""Host-side timing of a DDTREE server's decode rounds, for ``/server_info``.

Where a round's time goes, per batch bucket (the power of two at or above the batch) and
verify width, over the last ``window`` rounds of each: ``gap`` (from the end of the previous
decode round to the start of this one: the scheduler's work between rounds; gaps over a
second are idle time and not kept), ``prefill`` (the part of that gap spent in prefill
rounds, their host time; 0 when none ran: a gap that grows at a steady load is told apart
as longer or more prefills or as more scheduler work), ``forward`` (the worker's whole
decode step: draft, tree, verify and commit, including its waits for the device),
``build`` (the draft head's top-K, the tree and the verify inputs: launches only, the host
does not wait there), ``policy`` (budget auto's plan, tree statistics and observation;
0 for a fixed budget) and, where the worker reports them (the spec-v1 worker), the rest of
``forward`` around the build: ``draft`` (from the round's start, after auto's plan, to the
build: the drafter's pass) and ``verify`` (the rest after the build, less auto's work:
the target's verify, its host synchronisation and the commit), so that forward = draft +
build + verify + policy.
Each as p50, p90, mean and max in milliseconds; beside them, per gap, ``prefills`` (how many
prefill rounds ran in it) and ``prefill_tokens`` (the tokens they prefilled, from the batch's
``extend_num_tokens``), so that more prefill time in a gap is told apart as more prefill
rounds, more tokens, or dearer tokens. A fixed budget and ``auto`` report the same
fields, so a round of ``auto`` can be set against the fixed budget it chose, phase by phase.

Recording costs a few ``perf_counter`` calls and deque appends per round.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Deque, Dict, Optional

PHASES = ("gap", "prefill", "forward", "draft", "build", "verify", "policy")
COUNTS = ("prefills", "prefill_tokens")  # per gap, beside the phases' milliseconds
IDLE_GAP_S = 1.0  # a longer gap between decode rounds is idle time, not scheduler work


class RoundTiming:
    def __init__(self, window: int = 512):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self._lock = threading.Lock()
        self._cells: Dict[tuple, Dict[str, Deque[float]]] = {}
        self._rounds: Dict[tuple, int] = {}
        self._last_end: Optional[float] = None
        # The prefill rounds since the last decode round: host time, rounds, tokens.
        self._prefill_s = 0.0
        self._prefills = 0
        self._prefill_tokens = 0

    def prefill_round(self, call, batch, *args, **kwargs):
        """Run one prefill (extend) round, ``call(batch, *args, **kwargs)``, and return its
        result; its host time, and the round and its tokens (``batch.extend_num_tokens``, 0
        where the batch has none: another rank's extend), count in the next decode round's
        gap."""
        start = time.perf_counter()
        result = call(batch, *args, **kwargs)
        self._prefill_s += time.perf_counter() - start
        self._prefills += 1
        self._prefill_tokens += int(getattr(batch, "extend_num_tokens", None) or 0)
        return result

    def record(
        self,
        bucket: int,
        width: int,
        *,
        start: float,
        end: float,
        build: float,
        policy: float = 0.0,
        draft: Optional[float] = None,
        verify: Optional[float] = None,
    ) -> None:
        """One decode round: ``start``/``end`` from ``time.perf_counter()``, ``build``,
        ``policy``, ``draft`` and ``verify`` in seconds (the last two left out where a worker
        does not split its round so: their summaries stay None)."""
        gap = None if self._last_end is None else start - self._last_end
        self._last_end = end
        prefill, self._prefill_s = self._prefill_s, 0.0
        prefills, self._prefills = self._prefills, 0
        tokens, self._prefill_tokens = self._prefill_tokens, 0
        key = (int(bucket), int(width))
        with self._lock:
            cell = self._cells.get(key)
            if cell is None:
                cell = {p: deque(maxlen=self.window) for p in PHASES + COUNTS}
                self._cells[key] = cell
            self._rounds[key] = self._rounds.get(key, 0) + 1
            if gap is not None and 0 <= gap <= IDLE_GAP_S:
                cell["gap"].append(gap * 1e3)
                cell["prefill"].append(prefill * 1e3)
                cell["prefills"].append(prefills)
                cell["prefill_tokens"].append(tokens)
            cell["forward"].append((end - start) * 1e3)
            cell["build"].append(build * 1e3)
            cell["policy"].append(policy * 1e3)
            for phase, seconds in (("draft", draft), ("verify", verify)):
                if seconds is not None:
                    cell[phase].append(seconds * 1e3)

    def snapshot(self) -> dict:
        """``{"window": N, "buckets": {bucket: {width: {"rounds": n, "<phase>_ms": {...},
        "prefills": {...}, "prefill_tokens": {...}}}}}`` (keys as strings, for JSON)."""
        with self._lock:
            buckets: Dict[str, Dict[str, dict]] = {}
            for (bucket, width), cell in sorted(self._cells.items()):
                entry = {"rounds": self._rounds[(bucket, width)]}
                for phase in PHASES:
                    entry[f"{phase}_ms"] = _summary(cell[phase])
                for count in COUNTS:
                    entry[count] = _summary(cell[count])
                buckets.setdefault(str(bucket), {})[str(width)] = entry
            return {"window": self.window, "buckets": buckets}


def _summary(samples) -> Optional[dict]:
    if not samples:
        return None
    ordered = sorted(samples)
    n = len(ordered)
    return {
        "p50": round(ordered[(n - 1) // 2], 4),
        "p90": round(ordered[min(n - 1, (9 * n) // 10)], 4),
        "mean": round(sum(ordered) / n, 4),
        "max": round(ordered[-1], 4),
    }
