"""The load generator: one pass of a prompt list against one server.

Closed loop (``concurrency`` requests in flight) or open loop (Poisson arrivals at
``request_rate`` req/s, still capped at ``concurrency`` in flight). Warmup requests run
first and are not recorded. Errors and timeouts are counted, not fatal, until the error
rate passes a threshold; then the pass stops early and says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddtree_cli.bench.client import Endpoint
from ddtree_cli.bench.metrics import request_record
from ddtree_cli.bench.workloads import Prompt

MIN_REQUESTS_FOR_STOP = 5
DEATH_GRACE_S = 1.0


@dataclass(frozen=True)
class PassSpec:
    arm: str
    concurrency: int
    trial: int
    sampling: dict[str, Any]
    request_rate: float = math.inf
    warmup: int = 1
    timeout: float = 300.0
    max_error_rate: float = 0.2
    seed: int = 0
    incremental: bool = False


@dataclass
class PassResult:
    arm: str
    concurrency: int
    trial: int
    wall_s: float = 0.0
    records: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None  # why the pass ended early, if it did

    @property
    def errors(self) -> int:
        return sum(1 for r in self.records if not r["ok"])

    def throughput(self) -> dict[str, float]:
        ok = [r for r in self.records if r["ok"]]
        tokens = sum(r["completion_tokens"] for r in ok)
        wall = self.wall_s or math.nan
        return {"output_tok_s": tokens / wall, "request_s": len(ok) / wall}


def body_for(prompt: Prompt, sampling: dict[str, Any]) -> dict[str, Any]:
    return {**prompt.payload(), "sampling_params": dict(sampling)}


async def run_pass(
    endpoint: Endpoint,
    prompts: list[Prompt],
    spec: PassSpec,
    *,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    alive: Callable[[float], str | None] | None = None,
    result: PassResult | None = None,
) -> PassResult:
    """Run warmup, then every prompt once; records go to ``on_record`` as they finish.

    ``alive(grace_s)`` returns None while the server is fine, or a reason to stop now,
    waiting up to ``grace_s`` seconds for a dying server's exit to show. Pass your
    own ``result`` to keep what was measured when the pass is cancelled half-way.
    """
    if result is None:
        result = PassResult(spec.arm, spec.concurrency, spec.trial)
    await _warmup(endpoint, prompts, spec)
    bodies = [body_for(p, spec.sampling) for p in prompts]
    stop = asyncio.Event()
    limit = asyncio.Semaphore(spec.concurrency)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        async with limit:
            if stop.is_set():
                return
            res = await endpoint.stream_generate(
                bodies[i], timeout=spec.timeout, incremental=spec.incremental
            )
        rec = request_record(
            res,
            arm=spec.arm,
            concurrency=spec.concurrency,
            trial=spec.trial,
            prompt_id=prompts[i].id,
            index=i,
            pass_start=t0,
        )
        result.records.append(rec)
        if on_record is not None:
            on_record(rec)
        reason = _should_stop(result, len(prompts), spec.max_error_rate, alive)
        if reason and not stop.is_set():
            result.stopped = reason
            stop.set()

    tasks = []
    gaps = _arrival_gaps(len(prompts), spec.request_rate, spec.seed)
    for i, gap in enumerate(gaps):
        if gap > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), gap)
        if stop.is_set():
            break
        tasks.append(asyncio.ensure_future(one(i)))
    try:
        await _until_done_or_stopped(tasks, stop)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        result.wall_s = _measured_wall(result.records, t0)
    return result


async def _until_done_or_stopped(tasks: list[asyncio.Task], stop: asyncio.Event) -> None:
    if not tasks:
        return
    stopper = asyncio.ensure_future(stop.wait())
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(
                pending | {stopper}, return_when=asyncio.FIRST_COMPLETED
            )
            if stopper in done:
                return
            pending.discard(stopper)
    finally:
        stopper.cancel()


def _measured_wall(records: list[dict[str, Any]], t0: float) -> float:
    # From the first request sent to the last response finished; idle time after a stop
    # is not counted.
    if not records:
        return 0.0
    return max(r["start_s"] + r["e2e_ms"] / 1000.0 for r in records)


def _should_stop(
    result: PassResult,
    total: int,
    max_error_rate: float,
    alive: Callable[[float], str | None] | None,
) -> str | None:
    if alive is not None:
        reason = alive(0.0)
        if reason:
            return reason
    done = len(result.records)
    errors = result.errors
    if done >= min(MIN_REQUESTS_FOR_STOP, total) and errors / done > max_error_rate:
        # A server that was just killed refuses connections a moment before its exit
        # status can be read: give it a second, so the cause is named, not the symptom.
        reason = alive(DEATH_GRACE_S) if alive is not None else None
        if reason:
            return reason
        last = next(r["error"] for r in reversed(result.records) if not r["ok"])
        return (
            f"{errors} of {done} requests to arm '{result.arm}' failed "
            f"(error rate above {max_error_rate:.0%}); last error: {last}"
        )
    return None


def _arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: all zero for a closed loop, else exponential."""
    if not math.isfinite(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


async def _warmup(endpoint: Endpoint, prompts: list[Prompt], spec: PassSpec) -> None:
    """Warm the server and the connection pool; results are discarded on purpose."""
    if spec.warmup <= 0 or not prompts:
        return
    sampling = dict(spec.sampling)
    sampling["max_new_tokens"] = min(int(sampling.get("max_new_tokens", 16)), 16)
    n = min(spec.warmup, len(prompts))
    await asyncio.gather(
        *(
            endpoint.stream_generate(body_for(prompts[i], sampling), timeout=spec.timeout)
            for i in range(n)
        )
    )
