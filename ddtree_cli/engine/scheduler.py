"""The scheduler loop: one thread owns the engine; request threads submit and wait.

Each iteration admits waiting requests (prefill, up to ``max_batch`` rows) and then runs one
verify round for every running request together, so concurrent requests are batched
whatever their lengths. Results travel back through one queue per request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ddtree_cli.engine.decoding import Engine, RequestState
from ddtree_cli.errors import DdtreeError

log = logging.getLogger("ddtree.serve")


@dataclass
class Request:
    seq: RequestState
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished_time: float | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    error: str | None = None

    @property
    def e2e_latency(self) -> float:
        return (self.finished_time or time.perf_counter()) - self.created


# Latency histogram buckets in seconds (Prometheus ``le`` bounds).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self):
        self.counts = [0] * len(BUCKETS)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


@dataclass
class Stats:
    num_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_verify_calls: int = 0  # request-rounds, as SGLang counts them
    spec_accept_tokens: int = 0  # tokens those rounds accepted (drafts + bonus)
    spec_correct_drafts: int = 0
    num_aborted: int = 0
    max_running: int = 0  # the largest batch one round has decoded
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)

    @property
    def avg_spec_accept_length(self) -> float:
        if not self.spec_verify_calls:
            return 0.0
        return self.spec_accept_tokens / self.spec_verify_calls


class Scheduler:
    def __init__(self, build_engine: Callable[[], Engine]):
        self._build_engine = build_engine
        self.engine: Engine | None = None
        self.ready = threading.Event()
        self.failed: str | None = None
        self.stats = Stats()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}
        self._aborts: set[int] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ddtree-scheduler", daemon=True)
        self.last_throughput = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, seq: RequestState, rid: str | None = None) -> Request:
        req = Request(seq) if rid is None else Request(seq, rid=rid)
        with self._cond:
            self._waiting.append(req)
            self._cond.notify()
        return req

    def abort(self, req: Request) -> None:
        """Stop generating for a request whose client disconnected."""
        with self._cond:
            if req in self._waiting:
                self._waiting.remove(req)
                return
            self._aborts.add(id(req.seq))
            self._cond.notify()

    # ---- the loop --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
        except DdtreeError as exc:  # the server reports it on /health and exits
            self.failed = exc.message
            self.ready.set()
            return
        except Exception as exc:
            self.failed = repr(exc)
            log.exception("engine failed to start")
            self.ready.set()
            return
        self.ready.set()
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stop:
                    return
                aborts, self._aborts = self._aborts, set()
                admit = []
                while self._waiting and len(self._running) + len(admit) < self.engine.max_batch:
                    admit.append(self._waiting.popleft())
            for key in aborts:
                req = self._running.pop(key, None)
                if req is not None:
                    self.engine.drop(req.seq)
                    req.seq.finish_reason = {"type": "abort", "message": "client disconnected"}
                    self._fail(req, "client disconnected")
            try:
                self._iterate(admit)
            except Exception as exc:  # a bug: fail what is in flight, keep serving
                log.exception("engine round failed")
                for req in list(self._running.values()) + admit:
                    if req.finished_time is None:
                        self._fail(req, f"internal error: {exc!r}")
                self._running.clear()
                self.engine.seqs.clear()

    def _iterate(self, admit: list[Request]) -> None:
        engine = self.engine
        produced = 0
        start = time.perf_counter()
        ready = []
        for req in admit:
            self.stats.num_requests += 1
            self.stats.prompt_tokens += len(req.seq.prompt)
            if req.seq.max_new_tokens == 0:
                req.seq.finish_reason = {"type": "length", "length": 0}
                self._finish(req)
                continue
            try:
                engine.check(req.seq)
            except DdtreeError as exc:
                self._fail(req, exc.message)
                continue
            ready.append(req)
        if ready:
            for req in ready:
                self._running[id(req.seq)] = req
            firsts = engine.add_many([r.seq for r in ready])
            for req, tokens in zip(ready, firsts, strict=True):
                produced += len(tokens)
                self._deliver(req, tokens)
        self.stats.max_running = max(self.stats.max_running, len(engine.seqs))
        for seq, tokens in engine.step():
            produced += len(tokens)
            self._deliver(self._running[id(seq)], tokens)
        self.stats.spec_verify_calls = engine.total_rounds
        self.stats.spec_accept_tokens = engine.total_accepted
        self.stats.spec_correct_drafts = engine.total_accepted - engine.total_rounds
        elapsed = time.perf_counter() - start
        if elapsed > 0:
            self.last_throughput = produced / elapsed

    def _deliver(self, req: Request, tokens: list[int]) -> None:
        if tokens and req.first_token_time is None:
            req.first_token_time = time.perf_counter()
            self.stats.ttft.observe(req.first_token_time - req.created)
        self.stats.generation_tokens += len(tokens)
        if tokens:
            req.events.put(("tokens", tokens))
        if req.seq.finished:
            self._running.pop(id(req.seq), None)
            self._finish(req)

    def _finish(self, req: Request) -> None:
        req.finished_time = time.perf_counter()
        self.stats.e2e.observe(req.e2e_latency)
        req.events.put(("done", None))

    def _fail(self, req: Request, message: str) -> None:
        req.error = message
        req.finished_time = time.perf_counter()
        self.stats.num_aborted += 1
        req.events.put(("error", message))
