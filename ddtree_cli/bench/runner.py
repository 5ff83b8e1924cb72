"""The A/B run: targets, readiness, the confound guard, interleaved trials, results.

Whatever happens — completion, an error-rate stop, a dead server, Ctrl-C — the run folder
gets the per-request JSONL written so far, ``summary.json``, ``report.md`` and the plots,
and ``summary.json``'s ``status`` says which of those endings it was.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from ddtree_cli import __version__
from ddtree_cli.bench import analysis, fingerprint, lossless, routers
from ddtree_cli.bench.client import Endpoint, HttpError
from ddtree_cli.bench.loadgen import PassResult, PassSpec, run_pass
from ddtree_cli.bench.monitor import ClientMonitor, load_warning
from ddtree_cli.bench.servers import EMBEDDED_ALGOS, ServeProcess, wait_all_ready
from ddtree_cli.bench.summary import (
    REFERENCE,
    ClientPass,
    Comparison,
    Confounds,
    Files,
    Replica,
    RoutedArm,
    RunConfig,
    RunStatus,
    Summary,
    SweepPoint,
)
from ddtree_cli.bench.workloads import Prompt, load_workload
from ddtree_cli.budget_policy import budget_options
from ddtree_cli.errors import ConfigError, DdtreeError, ExitCode, UsageError

PROMPTS_PER_SLOT = 5  # the steady-state guard: prompts >= 5 x concurrency
UNREACHABLE_AFTER_S = 5.0  # connection refused for this long: a wrong URL, not a slow start
ANSWER_TIMEOUT_S = 10.0  # one GET of /health or /server_info


@dataclass(frozen=True)
class Workload:
    """What a run measures when the options leave it open; it depends on the target."""

    dataset: str
    min_prompts: int  # and never fewer than PROMPTS_PER_SLOT x the point's concurrency
    max_new_tokens: int
    trials: int


# Your servers: a quick look that says nothing about speed; raise everything for real numbers.
SERVER_WORKLOAD = Workload(dataset="code", min_prompts=5, max_new_tokens=16, trials=3)
# No --url: the embedded pair on this machine's CPU, as a first run. Its own kind of text
# (held-out stdlib files), and long enough that acceptance decides, not prefill and HTTP: a
# request is ~25 DFlash rounds. About a minute on two idle cores; docs/performance.md has the
# measurements behind these numbers.
EMBEDDED_WORKLOAD = Workload(dataset="stdlib", min_prompts=16, max_new_tokens=128, trials=5)


@dataclass
class BenchOptions:
    algo: str = "ddtree"
    baseline: str | None = "dflash"
    urls: dict[str, str] = field(default_factory=dict)
    reference: str | None = None
    # Time the reference too, interleaved with the arms: each arm over plain decoding.
    time_reference: bool = False
    # None: from the target's Workload (with_defaults).
    dataset: str | None = None
    # One count for every point of the --concurrency sweep, or one per point (a list as long
    # as ``concurrency``, in its order).
    num_prompts: int | list[int] | None = None
    max_new_tokens: int | None = None
    temperature: float = 0.0
    concurrency: list[int] = field(default_factory=lambda: [1])
    request_rate: float = math.inf
    trials: int | None = None
    warmup: int = 1
    seed: int = 0
    timeout: float = 300.0
    max_error_rate: float = 0.2
    output: Path | None = None
    allow_mismatch: bool = False
    random_input_len: int = 32
    # Embedded engine only.
    model: Path | None = None
    budget: int | str | None = None  # a number or "auto"
    max_budget: int | None = None
    block_size: int | None = None
    server_timeout: float = 300.0
    # One host whose service is switched between the arms (deploy module).
    host: str | None = None
    config: Path | None = None
    identity: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    service_port: int | None = None

    @property
    def embedded(self) -> bool:
        return not self.urls and not self.host

    def with_defaults(self) -> BenchOptions:
        """These options with every workload field left open filled in for the target."""
        w = EMBEDDED_WORKLOAD if self.embedded else SERVER_WORKLOAD
        return replace(
            self,
            dataset=w.dataset if self.dataset is None else self.dataset,
            num_prompts=default_prompts(w, self.concurrency or [1])
            if self.num_prompts is None
            else self.num_prompts,
            max_new_tokens=w.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens,
            trials=w.trials if self.trials is None else self.trials,
        )

    @property
    def per_point(self) -> bool:
        """Whether the sweep points have their own prompt counts (a list of them)."""
        return isinstance(self.num_prompts, list)

    def prompts_per_point(self) -> list[int]:
        """The prompt count of each point of ``concurrency``, in its order (after
        :meth:`with_defaults`)."""
        n = self.num_prompts
        assert n is not None
        return list(n) if isinstance(n, list) else [n] * len(self.concurrency)


def default_prompts(w: Workload, concurrency: list[int]) -> int | list[int]:
    """What each point of a sweep gets when --num-prompts is not given: what a run at that
    concurrency alone gets, the workload's minimum or PROMPTS_PER_SLOT x the concurrency,
    whichever is larger. One count when every point gets the same."""
    counts = [max(w.min_prompts, PROMPTS_PER_SLOT * c) for c in concurrency]
    return counts[0] if len(set(counts)) == 1 else counts


class Reporter(Protocol):
    def phase(self, text: str) -> None: ...
    def pass_started(self, arm: str, concurrency: int, trial: int, total: int) -> None: ...
    def request_done(self, record: dict[str, Any]) -> None: ...
    def pass_done(self, result: PassResult) -> None: ...


class QuietReporter:
    def phase(self, text: str) -> None:
        pass

    def pass_started(self, arm: str, concurrency: int, trial: int, total: int) -> None:
        pass

    def request_done(self, record: dict[str, Any]) -> None:
        pass

    def pass_done(self, result: PassResult) -> None:
        pass


@dataclass
class RunState:
    opts: BenchOptions
    arms: list[str]
    prompts: list[Prompt]
    run_dir: Path | None = None
    status: RunStatus = RunStatus.RUNNING
    reason: str | None = None
    passes: list[PassResult] = field(default_factory=list)
    reference_outputs: dict[str, list[int]] = field(default_factory=dict)
    server_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    routed: dict[str, RoutedArm] = field(default_factory=dict)  # arms whose URL is a router
    urls: dict[str, str] = field(default_factory=dict)
    differences: list[fingerprint.Difference] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    client_load: list[ClientPass] = field(default_factory=list)
    started: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    switcher: Any = None
    _jsonl: Any = None

    @property
    def baseline(self) -> str | None:
        """The arm every other arm is compared with; None when --algo runs alone."""
        base = self.opts.baseline
        return base if len(self.arms) > 1 and base == self.arms[-1] else None

    @property
    def timed(self) -> list[str]:
        """What each trial measures: the arms, and the reference with --time-reference."""
        return self.arms + ([REFERENCE] if self.opts.time_reference else [])

    @property
    def under_test(self) -> list[str]:
        """The arms of --algo (one, or several configurations: ddtree-b15, ddtree-b64)."""
        return [arm for arm in self.arms if arm != self.baseline]


@dataclass
class BenchOutcome:
    summary: Summary
    run_dir: Path
    error: DdtreeError | None  # set when the run did not end cleanly or a check failed


def resolve_arms(opts: BenchOptions) -> list[str]:
    baseline = None if opts.baseline in (None, "", "none") else opts.baseline
    if baseline == opts.algo:
        raise UsageError(f"--algo and --baseline are both '{opts.algo}'")
    if opts.host or opts.config:
        if opts.urls:
            raise UsageError("--host switches one service between the arms; drop --url")
        if not (opts.host and opts.config):
            raise UsageError("--host and --config go together (the deploy config to switch)")
        return [opts.algo] + ([baseline] if baseline else [])
    if opts.embedded:
        for name in filter(None, (opts.algo, baseline)):
            if name not in EMBEDDED_ALGOS:
                raise UsageError(
                    f"the embedded engine has no algorithm '{name}'",
                    hint=f"use {', '.join(EMBEDDED_ALGOS)}, or point --url at your servers",
                )
        return [opts.algo] + ([baseline] if baseline else [])
    under_test = [n for n in opts.urls if n != baseline and is_arm_of(n, opts.algo)]
    unknown = set(opts.urls) - set(under_test) - {baseline}
    if unknown:
        raise UsageError(
            f"--url names arm(s) {', '.join(sorted(unknown))}, which are neither --algo "
            f"'{opts.algo}' (or '{opts.algo}-SUFFIX') nor --baseline '{baseline}'",
            hint="write --url ddtree=http://HOST:PORT --url dflash=http://HOST:PORT, or "
            "several arms under test as --url ddtree-b15=... --url ddtree-b64=...",
        )
    if not under_test:
        raise UsageError(f"no --url for the arm under test '{opts.algo}'")
    return under_test + ([baseline] if baseline in opts.urls else [])


def is_arm_of(name: str, algo: str) -> bool:
    """``ddtree`` and ``ddtree-b64`` are arms of --algo ddtree: one algorithm, several
    configurations (a budget sweep), each compared with the one baseline."""
    return name == algo or (name.startswith(f"{algo}-") and len(name) > len(algo) + 1)


def prepare(opts: BenchOptions) -> tuple[list[str], list[Prompt]]:
    """Validate options and load prompts; raises before anything starts or is written."""
    opts = opts.with_defaults()
    if opts.trials < 1:
        raise UsageError("--trials must be at least 1")
    if not opts.concurrency or min(opts.concurrency) < 1:
        raise UsageError("--concurrency needs positive integers, e.g. 1,4,16")
    twice = sorted({c for c in opts.concurrency if opts.concurrency.count(c) > 1})
    if twice:
        raise UsageError(f"--concurrency {_csv(opts.concurrency)} lists {twice[0]} twice")
    if opts.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if not 0.0 <= opts.max_error_rate <= 1.0:
        raise UsageError("--max-error-rate is a fraction between 0 and 1")
    arms = resolve_arms(opts)
    check_budget(opts, arms)
    if opts.time_reference and not opts.reference:
        raise UsageError("--time-reference needs --reference URL (the plain server to time)")
    _check_prompt_counts(opts)
    # The point with N prompts runs the first N of this list: exactly the prompts that
    # --num-prompts N alone would choose (a seeded order that does not depend on N).
    prompts = load_workload(
        opts.dataset,
        max(opts.prompts_per_point()),
        seed=opts.seed,
        random_input_len=opts.random_input_len,
    )
    return arms, prompts


def _check_prompt_counts(opts: BenchOptions) -> None:
    """Every point gets at least PROMPTS_PER_SLOT x its concurrency prompts."""
    n = opts.num_prompts
    if not isinstance(n, list):
        need = PROMPTS_PER_SLOT * max(opts.concurrency)
        if n < need:
            raise UsageError(
                f"--num-prompts {n} is below {PROMPTS_PER_SLOT} x the concurrency "
                f"{max(opts.concurrency)} (= {need}): the run would never reach a steady state",
                hint=f"use --num-prompts {need} or more",
            )
        return
    if len(n) != len(opts.concurrency):
        raise UsageError(
            f"--num-prompts {_csv(n)} has {_values(n)} but --concurrency "
            f"{_csv(opts.concurrency)} has {_values(opts.concurrency)}",
            hint="give one --num-prompts for every point, or one per concurrency in its order",
        )
    for count, c in zip(n, opts.concurrency, strict=True):
        need = PROMPTS_PER_SLOT * c
        if count < need:
            raise UsageError(
                f"--num-prompts {_csv(n)}: {count} prompts at concurrency {c} is below "
                f"{PROMPTS_PER_SLOT} x the concurrency {c} (= {need}): that point would never "
                "reach a steady state",
                hint=f"give concurrency {c} {need} prompts or more",
            )


def _csv(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def _values(values: list[int]) -> str:
    return f"{len(values)} value{'' if len(values) == 1 else 's'}"


def check_budget(opts: BenchOptions, arms: list[str]) -> None:
    """--budget / --max-budget: values ``ddtree serve`` takes, for an embedded ddtree arm."""
    if opts.budget is None and opts.max_budget is None:
        return
    if opts.embedded and "ddtree" not in arms:
        raise UsageError("--budget and --max-budget apply to the ddtree arm, and none runs")
    try:
        budget_options(opts.budget, opts.max_budget)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_bench(opts: BenchOptions, reporter: Reporter | None = None) -> BenchOutcome:
    reporter = reporter or QuietReporter()
    opts = opts.with_defaults()
    arms, prompts = prepare(opts)
    state = RunState(opts, arms, prompts)
    servers: list[ServeProcess] = []
    switcher = None
    if opts.host:
        from ddtree_cli.bench.switching import ServiceSwitcher

        switcher = ServiceSwitcher(
            opts.config,
            opts.host,
            identity=opts.identity,
            known_hosts=opts.known_hosts,
            accept_new_host_key=opts.accept_new_host_key,
            service_port=opts.service_port,
        )
        switcher.check_arms(arms)
    state.switcher = switcher
    log_dir = Path(tempfile.mkdtemp(prefix="ddtree-bench-"))
    error: DdtreeError | None = None
    try:
        # With a switcher, URLs come from the deploys, arm by arm, inside the run.
        if switcher is None and opts.embedded:
            reporter.phase(f"starting ddtree serve for {', '.join(arms)}")
            servers = [ServeProcess(arm, arm, log_dir, _serve_args(opts, arm)) for arm in arms]
            for s in servers:
                s.start()
            wait_all_ready(servers, opts.server_timeout)
            state.urls = {s.arm: s.url for s in servers if s.url}
        elif switcher is None:
            state.urls = {arm: opts.urls[arm] for arm in arms}
        asyncio.run(_main(state, servers, reporter))
        state.status = RunStatus.COMPLETE
    except KeyboardInterrupt:
        if state.run_dir is None:
            raise
        state.status = RunStatus.INTERRUPTED
        state.reason = "interrupted by the user"
        error = DdtreeError("interrupted", exit_code=ExitCode.INTERRUPTED)
    except DdtreeError as exc:
        if state.run_dir is None:
            raise
        state.status = RunStatus.STOPPED
        state.reason = exc.message
        error = exc
    finally:
        for s in servers:
            s.stop()
        if state.run_dir is not None:
            for s in servers:
                if s.log_path.exists():
                    shutil.copy(s.log_path, state.run_dir / s.log_path.name)
        shutil.rmtree(log_dir, ignore_errors=True)
        if state._jsonl is not None:
            state._jsonl.close()
    assert state.run_dir is not None
    summary = finish(state)
    if error is None:
        error = _check_failure(summary, state.run_dir)
    elif error.exit_code != ExitCode.INTERRUPTED:
        error = DdtreeError(
            f"run stopped: {error.message}; partial results in {state.run_dir}",
            hint=error.hint,
        )
    else:
        error = DdtreeError(
            f"interrupted; partial results in {state.run_dir}", exit_code=ExitCode.INTERRUPTED
        )
    return BenchOutcome(summary, state.run_dir, error)


def _serve_args(opts: BenchOptions, algo: str) -> list[str]:
    """``ddtree serve`` options of the embedded arm running ``algo``: the same for every arm
    but DDTree's own budget options."""
    args: list[str] = []
    if opts.model is not None:
        args += ["--model", str(opts.model)]
    if algo == "ddtree" and opts.budget is not None:
        args += ["--budget", str(opts.budget)]
    if algo == "ddtree" and opts.max_budget is not None:
        args += ["--max-budget", str(opts.max_budget)]
    if opts.block_size is not None:
        args += ["--block-size", str(opts.block_size)]
    args += ["--max-running-requests", str(max(8, max(opts.concurrency)))]
    return args


async def _activate(
    state: RunState, arm: str, endpoints: dict[str, Endpoint], reporter: Reporter
) -> None:
    """With --host: make ``arm`` the running service (a restart) unless it already is."""
    switcher = state.switcher
    if switcher is None or switcher.active == arm:
        return
    reporter.phase(f"switching {state.opts.host} to {arm} (deploy, restart, wait healthy)")
    url = await asyncio.to_thread(switcher.switch, arm)
    state.urls[arm] = url
    if arm not in endpoints or endpoints[arm].url != url.rstrip("/"):
        endpoints[arm] = Endpoint(url)


async def _main(state: RunState, servers: list[ServeProcess], reporter: Reporter) -> None:
    opts = state.opts
    endpoints = {arm: Endpoint(url) for arm, url in state.urls.items()}
    sampling = {"max_new_tokens": opts.max_new_tokens, "temperature": opts.temperature}
    reporter.phase("reading /server_info")
    for arm in state.arms:
        await _activate(state, arm, endpoints, reporter)
        ep = endpoints[arm]
        info = await _ready_info(f"arm '{arm}' at {ep.url}", ep, opts.server_timeout)
        if routers.is_router(info):
            reporter.phase(f"reading /server_info of every replica behind the {arm} router")
            state.routed[arm] = await _replicas(arm, ep, info, opts.server_timeout)
            info = state.routed[arm].replicas[0].server_info
        state.server_info[arm] = info
        await _canary(state, arm, ep, sampling)
    _guard_confounds(state)
    ref_ep = Endpoint(opts.reference) if opts.reference else None
    if ref_ep is not None:
        state.server_info[REFERENCE] = await _ready_info(
            f"arm '{REFERENCE}' at {ref_ep.url}", ref_ep, 30.0
        )
        if opts.time_reference:
            _guard_reference(state)
            endpoints[REFERENCE] = ref_ep
    _create_run_dir(state)
    if ref_ep is not None:
        await _reference_pass(state, ref_ep, sampling, reporter)
    alive = {s.arm: s for s in servers}
    rng = random.Random(opts.seed)
    for concurrency, count in zip(opts.concurrency, opts.prompts_per_point(), strict=True):
        prompts = state.prompts[:count]
        for trial in range(1, opts.trials + 1):
            order = list(state.timed)
            rng.shuffle(order)
            for arm in order:
                await _activate(state, arm, endpoints, reporter)
                spec = PassSpec(
                    arm=arm,
                    concurrency=concurrency,
                    trial=trial,
                    sampling=sampling,
                    request_rate=opts.request_rate,
                    warmup=opts.warmup,
                    timeout=opts.timeout,
                    max_error_rate=opts.max_error_rate,
                    seed=opts.seed + trial,
                    incremental=bool(state.server_info[arm].get("incremental_streaming_output")),
                )
                await _one_pass(state, endpoints[arm], spec, prompts, alive.get(arm), reporter)
    for ep in {id(ep): ep for ep in endpoints.values()}.values():
        ep.close()


async def _one_pass(
    state: RunState,
    ep: Endpoint,
    spec: PassSpec,
    prompts: list[Prompt],
    server: ServeProcess | None,
    reporter: Reporter,
) -> None:
    reporter.pass_started(spec.arm, spec.concurrency, spec.trial, len(prompts))
    monitor = ClientMonitor()
    monitor.start()

    def alive(grace_s: float) -> str | None:
        if server is None:
            return None
        died = server.exit_reason(grace_s)
        return f"ddtree serve for arm '{spec.arm}' {died}" if died else None

    def on_record(rec: dict[str, Any]) -> None:
        _write_record(state, rec)
        reporter.request_done(rec)

    result = PassResult(spec.arm, spec.concurrency, spec.trial)
    state.passes.append(result)
    try:
        await run_pass(ep, prompts, spec, on_record=on_record, alive=alive, result=result)
    finally:
        load = await monitor.stop()
        state.client_load.append(ClientPass(spec.arm, spec.concurrency, spec.trial, load))
    reporter.pass_done(result)
    if result.stopped:
        if server is not None:
            # A killed server closes its sockets a moment before it can be reaped, so the
            # failed requests may be seen first: give the process a moment to be reaped.
            for _ in range(20):
                if server.exit_reason():
                    break
                await asyncio.sleep(0.1)
        if server is not None and server.exit_reason():
            raise DdtreeError(
                f"ddtree serve for arm '{spec.arm}' {server.exit_reason()}",
                hint=server.log_hint(),
            )
        raise DdtreeError(result.stopped)


async def _replicas(arm: str, router: Endpoint, info: dict[str, Any], timeout: float) -> RoutedArm:
    """Every replica the router at ``router`` lists, with its own /server_info."""
    try:
        status, body = await router.get_json(routers.WORKERS_PATH, timeout=ANSWER_TIMEOUT_S)
    except (TimeoutError, asyncio.TimeoutError, OSError, HttpError) as exc:
        raise DdtreeError(
            f"arm '{arm}': the router at {router.url} did not answer GET "
            f"{routers.WORKERS_PATH}: {exc or type(exc).__name__}"
        ) from None
    replicas = []
    for url in routers.worker_urls(router.url, status, body):
        ep = Endpoint(url)
        try:
            who = f"arm '{arm}': replica {ep.url} behind the router at {router.url}"
            replicas.append(Replica(ep.url, await _ready_info(who, ep, timeout)))
        finally:
            ep.close()
    return RoutedArm(router.url, info, replicas)


async def _ready_info(who: str, ep: Endpoint, timeout: float) -> dict[str, Any]:
    """Wait for /health, then return /server_info (or /get_server_info on older servers and
    on SGLang's router, whose summary :func:`routers.is_router` recognises). ``who`` names
    the server in errors ("arm 'ddtree' at URL").

    A refused connection for UNREACHABLE_AFTER_S is a wrong URL; a server that answers (503
    while starting) or accepts the connection and stays silent (busy starting) is waited for
    up to ``timeout`` (--server-timeout)."""
    start = time.monotonic()
    answered = silent = False
    last = ""
    while True:
        ask = max(0.5, min(ANSWER_TIMEOUT_S, timeout - (time.monotonic() - start)))
        try:
            status, body = await ep.get_json("/health", timeout=ask)
            answered = True
            if status == 200:
                break
            last = f"/health answered {status}"
        except (TimeoutError, asyncio.TimeoutError):  # first: an OSError since Python 3.11
            silent = True
            last = f"it accepted the connection but sent no answer to GET /health within {ask:g} s"
        except (OSError, HttpError) as exc:
            last = str(exc) or type(exc).__name__
        waited = time.monotonic() - start
        if waited > timeout or (not (answered or silent) and waited > UNREACHABLE_AFTER_S):
            there = answered or silent
            raise DdtreeError(
                f"{who} is not {'healthy' if there else 'reachable'} after {waited:.0f} s: {last}",
                hint=f"if it is still starting, wait longer with --server-timeout (now "
                f"{timeout:g} s); otherwise check the server's log"
                if there
                else "check the URL and that the server is running",
            )
        await asyncio.sleep(0.5)
    for path in ("/server_info", "/get_server_info"):
        try:
            status, body = await ep.get_json(path, timeout=ANSWER_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            raise DdtreeError(
                f"{who} sent no answer to GET {path} within "
                f"{ANSWER_TIMEOUT_S:g} s (its /health answered 200)",
                hint="check the server's log; a server busy with other clients answers late",
            ) from None
        if status == 200 and isinstance(body, dict):
            return body
    raise DdtreeError(f"{who} has no /server_info (got HTTP {status})")


def _guard_confounds(state: RunState) -> None:
    """Every arm behind a router must be one server configuration on all its replicas; then
    the arms are compared (replica by replica where there are several)."""
    fps = {}
    for arm in state.arms:
        routed = state.routed.get(arm)
        if routed is None:
            fps[arm] = [fingerprint.fingerprint(state.server_info[arm])]
            continue
        by_url = {r.url: fingerprint.fingerprint(r.server_info) for r in routed.replicas}
        routed.differences = fingerprint.compare_replicas(by_url)
        fps[arm] = list(by_url.values())
        if routed.differences and not state.opts.allow_mismatch:
            raise DdtreeError(
                f"the replicas of arm '{arm}' behind the router at {routed.router} differ — "
                + _shown(routed.differences),
                hint="start every replica of an arm with the same model and flags (only the "
                "GPU may differ), or pass --allow-mismatch",
                exit_code=ExitCode.CHECK_FAILED,
            )
    if len(state.arms) < 2:
        return
    state.differences = fingerprint.compare_arms(fps)
    if not state.differences or state.opts.allow_mismatch:
        return
    raise DdtreeError(
        "the arms differ in more than the algorithm — " + _shown(state.differences),
        hint="make the servers identical but for the algorithm, or pass --allow-mismatch",
        exit_code=ExitCode.CHECK_FAILED,
    )


def _guard_reference(state: RunState) -> None:
    """A timed reference gives each arm's speed-up over plain decoding: it must be the arms'
    server but for speculation (model, hardware, flags)."""
    names = [*state.arms, REFERENCE]
    fps = {name: fingerprint.fingerprint(state.server_info[name]) for name in names}
    diffs = fingerprint.compare_with_plain(fps)
    if not diffs:
        return
    what = "the timed reference differs from the arms in more than speculation — " + _shown(diffs)
    if state.opts.allow_mismatch:
        state.warnings.append(what)
        return
    raise DdtreeError(
        what,
        hint="start the plain server with the arms' model and flags, or pass --allow-mismatch",
        exit_code=ExitCode.CHECK_FAILED,
    )


def _shown(diffs: list[fingerprint.Difference], at_most: int = 4) -> str:
    """``key: a=1, b=2; ...`` for the first few differences."""
    shown = "; ".join(
        f"{d.key}: " + ", ".join(f"{name}={_short(v)}" for name, v in d.values.items())
        for d in diffs[:at_most]
    )
    more = len(diffs) - at_most
    return shown + (f" (and {more} more)" if more > 0 else "")


def _short(value: Any, width: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 1] + "…"


async def _canary(state: RunState, arm: str, ep: Endpoint, sampling: dict[str, Any]) -> None:
    """One short request before measuring: the server answers, and speculation is on."""
    body = {**state.prompts[0].payload(), "sampling_params": {**sampling, "max_new_tokens": 8}}
    res = await ep.stream_generate(body, timeout=state.opts.timeout)
    if not res.ok:
        raise DdtreeError(f"arm '{arm}' failed its first request: {res.error}")
    algo = fingerprint.algorithm_of(state.server_info[arm])
    verify = ((res.final or {}).get("meta_info") or {}).get("spec_verify_ct")
    if algo and not verify:
        state.warnings.append(
            f"arm '{arm}' reports speculative_algorithm {algo} but no spec_verify_ct: "
            "speculative decoding may be off"
        )


async def _reference_pass(
    state: RunState, ep: Endpoint, sampling: dict[str, Any], reporter: Reporter
) -> None:
    if state.opts.temperature != 0:
        state.warnings.append("--reference needs temperature 0; the reference check is skipped")
        return
    spec = PassSpec(
        arm=REFERENCE,
        concurrency=max(state.opts.concurrency),
        trial=0,
        sampling=sampling,
        warmup=0,
        timeout=state.opts.timeout,
        max_error_rate=state.opts.max_error_rate,
    )
    reporter.phase("collecting the reference outputs")
    result = await run_pass(ep, state.prompts, spec, on_record=lambda r: _write_record(state, r))
    state.reference_outputs = {
        r["prompt_id"]: r["output_ids"]
        for r in result.records
        if r["ok"] and r.get("output_ids") is not None
    }
    if result.stopped:
        raise DdtreeError(f"reference server: {result.stopped}")


def _create_run_dir(state: RunState) -> None:
    opts = state.opts
    run_dir = opts.output or Path("runs") / datetime.now(timezone.utc).strftime(
        "bench-%Y%m%d-%H%M%S"
    )
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"{run_dir} exists and is not empty", hint="choose a new --output folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    state.run_dir = run_dir
    state._jsonl = open(run_dir / "requests.jsonl", "w", encoding="utf-8")  # noqa: SIM115


def _write_record(state: RunState, rec: dict[str, Any]) -> None:
    state._jsonl.write(json.dumps(rec, separators=(",", ":")) + "\n")
    state._jsonl.flush()


def _strict(state: RunState) -> bool:
    """Exact equality is demanded when both arms are the embedded engine in float32."""
    infos = [state.server_info.get(arm, {}) for arm in state.arms]
    return bool(infos) and all(
        i.get("engine") == "ddtree-embedded" and i.get("dtype") == "float32" for i in infos
    )


def finish(state: RunState) -> Summary:
    """Compute the summary from what was measured and write every output file."""
    from ddtree_cli.bench import plots, report

    assert state.run_dir is not None
    summary = build_summary(state)
    _write_json_atomic(state.run_dir / "summary.json", summary.to_json())
    (state.run_dir / "report.md").write_text(report.render(summary), encoding="utf-8")
    try:
        summary.files.plots = plots.render_all(summary, state.passes, state.run_dir)
    except Exception as exc:  # noqa: BLE001 — a plot must never cost the results
        summary.warnings.append(f"plots not written: {exc}")
    _write_json_atomic(state.run_dir / "summary.json", summary.to_json())
    (state.run_dir / "report.md").write_text(report.render(summary), encoding="utf-8")
    return summary


def build_summary(state: RunState) -> Summary:
    opts = state.opts
    records = [r for p in state.passes for r in p.records]
    sweep = []
    for c, count in zip(opts.concurrency, opts.prompts_per_point(), strict=True):
        by_arm = {
            arm: [p for p in state.passes if p.arm == arm and p.concurrency == c]
            for arm in state.timed
        }
        if not any(by_arm.values()):
            continue
        point = SweepPoint(
            concurrency=c,
            arms={arm: analysis.arm_metrics(ps) for arm, ps in by_arm.items() if ps},
            num_prompts=count if opts.per_point else None,
        )
        base = state.baseline
        if base is not None and by_arm[base]:
            compared = _against(by_arm, base, state.under_test, opts.seed)
            point.comparison = compared.get(state.under_test[0])
            if len(state.under_test) > 1:
                point.comparisons = compared
        if opts.time_reference and by_arm[REFERENCE]:
            point.over_reference = _against(by_arm, REFERENCE, state.arms, opts.seed)
        sweep.append(point)
    check = None
    if state.baseline is not None and opts.temperature == 0:
        check = _lossless_against_baseline(state, records)
        if state.reference_outputs:
            check.reference = _reference_check(state, records)
    elif state.reference_outputs:
        check = lossless.LosslessResult(tuple(state.arms), strict=False)
        check.reference = _reference_check(state, records)
    return Summary(
        tool=f"ddtree {__version__}",
        status=state.status,
        reason=state.reason,
        started=state.started,
        finished=datetime.now(timezone.utc).isoformat(),
        algo=opts.algo,
        baseline=state.baseline,
        target="embedded" if opts.embedded else ("host" if opts.host else "url"),
        host=opts.host,
        switches=state.switcher.switches if state.switcher is not None else None,
        urls=state.urls,
        reference=opts.reference,
        config=RunConfig(
            dataset=opts.dataset,
            num_prompts=list(opts.num_prompts) if opts.per_point else len(state.prompts),
            max_new_tokens=opts.max_new_tokens,
            temperature=opts.temperature,
            concurrency=opts.concurrency,
            request_rate=None if math.isinf(opts.request_rate) else opts.request_rate,
            trials=opts.trials,
            warmup=opts.warmup,
            seed=opts.seed,
            timeout_s=opts.timeout,
            max_error_rate=opts.max_error_rate,
        ),
        sweep=sweep,
        lossless=check or lossless.LosslessResult.not_run(),
        confounds=Confounds(list(state.differences), opts.allow_mismatch),
        server_info=state.server_info,
        client=state.client_load,
        warnings=_model_warnings(state) + state.warnings + _client_warnings(state.client_load),
        errors={
            arm: sum(1 for r in records if r["arm"] == arm and not r["ok"]) for arm in state.timed
        },
        files=Files(),
        run_dir=str(state.run_dir),
        replicas=dict(state.routed) or None,
    )


def _against(
    by_arm: dict[str, list[PassResult]], other: str, arms: list[str], seed: int
) -> dict[str, Comparison]:
    """Each measured arm of ``arms`` against arm ``other``, by arm."""
    return {
        arm: analysis.compare(by_arm[arm], by_arm[other], name_a=arm, seed=seed)
        for arm in arms
        if by_arm[arm]
    }


def _lossless_against_baseline(state: RunState, records: list[dict[str, Any]]):
    """Every arm under test against the baseline, token for token; one result. With one arm
    under test it is exactly :func:`lossless.compare_arms` of the two arms."""
    base = state.baseline
    assert base is not None
    strict = _strict(state)
    if len(state.arms) == 2:
        return lossless.compare_arms(records, state.arms[0], base, strict=strict)
    check = lossless.LosslessResult(tuple(state.arms), strict)
    for arm in state.under_test:
        pair = lossless.compare_arms(records, arm, base, strict=strict)
        check.compared += pair.compared
        check.mismatches += pair.mismatches
    return check


def _reference_check(state: RunState, records: list[dict[str, Any]]):
    """Each arm's divergence from the reference; with several arms under test, McNemar's
    test of each of them against the baseline, Holm-corrected (``lossless.against_baseline``)."""
    base = state.baseline
    if base is not None and len(state.arms) > 2:
        return lossless.against_baseline(
            records, state.reference_outputs, list(state.arms), list(state.under_test), base
        )
    return lossless.reference_divergence(records, state.reference_outputs, state.arms)


def _model_warnings(state: RunState) -> list[str]:
    random_arms = [
        arm
        for arm in state.arms
        if ((state.server_info.get(arm) or {}).get("model") or {}).get("random_init")
    ]
    if not random_arms:
        return []
    return [
        f"arm(s) {', '.join(random_arms)} run the embedded engine with fixed-seed RANDOM "
        "weights: acceptance and speed here say nothing about a trained model pair"
    ]


def _client_warnings(loads: list[ClientPass]) -> list[str]:
    """One warning for the worst pass, not one per pass."""
    if not loads:
        return []
    warning = load_warning(
        max(x.load.cpu_fraction for x in loads), max(x.load.lag_p99_ms for x in loads)
    )
    return [warning] if warning else []


def _check_failure(summary: Summary, run_dir: Path) -> DdtreeError | None:
    check = summary.lossless
    if check.ok is not False:
        return None
    flagged = check.flagged
    if flagged:
        return DdtreeError(
            f"lossless check failed: arm '{flagged[0]}' diverges from the reference clearly "
            f"more often than the arm it was compared with; see {run_dir / 'report.md'}",
            exit_code=ExitCode.CHECK_FAILED,
        )
    first = check.mismatches[0]
    return DdtreeError(
        f"lossless check failed: {len(check.mismatches)} of {check.compared} outputs "
        f"differ between the arms (first: prompt {first.prompt_id} at token "
        f"{first.position}); see {run_dir / 'report.md'}",
        exit_code=ExitCode.CHECK_FAILED,
    )


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
