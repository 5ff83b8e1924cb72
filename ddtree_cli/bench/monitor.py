"""The client watches itself: its CPU use and the event loop's lag while it measures.

A saturated client delays reading chunks, which inflates TTFT/ITL and deflates tok/s in
a way that looks like a server effect. No other serving benchmark reports this.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

CPU_WARN = 0.85  # fraction of one core
LAG_WARN_MS = 20.0  # p99 event-loop lag
_TICK = 0.01


@dataclass(frozen=True)
class ClientLoad:
    cpu_fraction: float  # client process CPU time / wall time (1.0 = one core busy)
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    wall_s: float
    warning: str | None

    def to_json(self) -> dict:
        return {
            "cpu_fraction": round(self.cpu_fraction, 4),
            "loop_lag_ms": {
                "p50": round(self.lag_p50_ms, 3),
                "p99": round(self.lag_p99_ms, 3),
                "max": round(self.lag_max_ms, 3),
            },
            "wall_s": round(self.wall_s, 3),
            "warning": self.warning,
        }


class ClientMonitor:
    """Start it inside the running loop; ``stop()`` returns what it saw."""

    def __init__(self) -> None:
        self._lags: list[float] = []
        self._task: asyncio.Task | None = None
        self._cpu0 = 0.0
        self._wall0 = 0.0

    def start(self) -> None:
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(_TICK)
            self._lags.append(max(0.0, time.perf_counter() - t0 - _TICK))

    async def stop(self) -> ClientLoad:
        if self._task is not None:
            self._task.cancel()
            # Wait for the probe without taking its CancelledError: suppressing it here
            # would also swallow a cancellation of the caller (Ctrl-C as a pass ends).
            await asyncio.wait([self._task])
        return summarize_load(
            time.process_time() - self._cpu0, time.perf_counter() - self._wall0, self._lags
        )


def summarize_load(cpu_s: float, wall_s: float, lags_s: list[float]) -> ClientLoad:
    cpu = cpu_s / wall_s if wall_s > 0 else 0.0
    lags = np.asarray(lags_s or [0.0]) * 1000.0
    p50, p99 = (float(v) for v in np.percentile(lags, [50, 99]))
    worst = float(lags.max())
    # Kept at the precision summary.json holds, so that report.md reads the same from this
    # object as from the stored file.
    cpu, wall_s = round(cpu, 4), round(wall_s, 3)
    p50, p99, worst = round(p50, 3), round(p99, 3), round(worst, 3)
    warning = load_warning(cpu, p99)
    return ClientLoad(cpu, p50, p99, worst, wall_s, warning)


def load_warning(cpu_fraction: float, lag_p99_ms: float) -> str | None:
    """A sentence when the client may have coloured the measurement, else None."""
    if cpu_fraction >= CPU_WARN:
        return (
            f"the client used {cpu_fraction:.0%} of a core: it may be the bottleneck; "
            "lower --concurrency or run the client on another machine"
        )
    if lag_p99_ms >= LAG_WARN_MS:
        return (
            f"the client's event loop ran up to {lag_p99_ms:.1f} ms late (p99): chunk timings "
            "(TTFT, ITL) are blurred by that much; the machine may be short of CPU"
        )
    return None
