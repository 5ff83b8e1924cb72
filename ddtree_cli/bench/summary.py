"""A bench run's result, typed: what ``summary.json`` (and ``bench --json``) holds.

:class:`Summary` is what :func:`ddtree_cli.bench.runner.run_bench` returns and what the CLI,
``report.md`` and the plots read, by attribute. ``to_json()`` renders the file's exact JSON
(key order included); ``Summary.from_json`` rebuilds it from a stored ``summary.json``, so a
report can be rendered again from the file alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ddtree_cli.bench.fingerprint import Difference
from ddtree_cli.bench.lossless import LosslessResult
from ddtree_cli.bench.monitor import ClientLoad

# The plain (--reference) server's name in the records and, when it is timed
# (--time-reference), among a sweep point's arms.
REFERENCE = "reference"


class RunStatus(str, Enum):
    """How the run ended; the values are the JSON strings of ``status``."""

    RUNNING = "running"
    COMPLETE = "complete"
    INTERRUPTED = "interrupted"  # Ctrl-C: partial results
    STOPPED = "stopped"  # an error-rate stop, a dead server: partial results

    def __str__(self) -> str:
        return self.value


@dataclass
class Percentiles:
    """``{"p50", "p90", "p99", "mean"}`` of a distribution; all None (``{}``) when empty."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None

    @property
    def empty(self) -> bool:
        return self.to_json() == {}

    def to_json(self) -> dict[str, float]:
        items = {"p50": self.p50, "p90": self.p90, "p99": self.p99, "mean": self.mean}
        return {k: v for k, v in items.items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, float] | None) -> Percentiles:
        return cls(**(data or {}))


@dataclass
class TrialThroughput:
    trial: int
    output_tok_s: float | None
    request_s: float | None
    wall_s: float | None
    requests: int
    errors: int
    stopped: str | None  # why the pass stopped early, if it did

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialThroughput:
        return cls(**data)


_PERCENTILE_METRICS = (
    "accept_length_per_request", "ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "tokens_per_chunk",
)  # fmt: skip


@dataclass
class ArmMetrics:
    """One arm at one concurrency, over its trials."""

    output_tok_s: float | None
    output_tok_s_ci95: tuple[float | None, float | None] | None
    request_s: float | None
    accept_length: float | None  # pooled: completion tokens / verify steps
    accept_length_per_request: Percentiles
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    itl_ms: Percentiles
    tokens_per_chunk: Percentiles
    completion_tokens: int
    requests: int
    errors: int
    spec_active: bool
    trials: list[TrialThroughput]
    trial_rel_mad: float | None
    noisy: bool

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in vars(self).items():
            if name in _PERCENTILE_METRICS:
                value = value.to_json()
            elif name == "trials":
                value = [t.to_json() for t in value]
            elif name == "output_tok_s_ci95" and value is not None:
                value = list(value)
            out[name] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArmMetrics:
        kwargs = dict(data)
        for name in _PERCENTILE_METRICS:
            kwargs[name] = Percentiles.from_json(kwargs[name])
        kwargs["trials"] = [TrialThroughput.from_json(t) for t in kwargs["trials"]]
        if kwargs["output_tok_s_ci95"] is not None:
            kwargs["output_tok_s_ci95"] = tuple(kwargs["output_tok_s_ci95"])
        return cls(**kwargs)


@dataclass
class Effect:
    """The ratio under-test / baseline of one metric, its interval and the verdict."""

    ratio: float | None
    ci95: tuple[float | None, float | None] | None
    n: int
    paired_by: str  # "trial" (throughput) or "prompt" (latency, acceptance)
    verdict: str
    wilcoxon_p: float | None = None  # per-prompt metrics only
    wilcoxon_method: str | None = None
    note: str | None = None  # why a difference the interval shows is not claimed

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ratio": self.ratio,
            "ci95": list(self.ci95) if self.ci95 is not None else None,
            "n": self.n,
            "paired_by": self.paired_by,
            "verdict": self.verdict,
        }
        if self.wilcoxon_method is not None:
            out["wilcoxon_p"] = self.wilcoxon_p
            out["wilcoxon_method"] = self.wilcoxon_method
        if self.note is not None:
            out["note"] = self.note
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Effect:
        kwargs = dict(data)
        if kwargs["ci95"] is not None:
            kwargs["ci95"] = tuple(kwargs["ci95"])
        return cls(**kwargs)


@dataclass
class Comparison:
    """Every compared metric of one concurrency, in report order."""

    output_tok_s: Effect
    request_s: Effect
    e2e_ms: Effect
    ttft_ms: Effect
    tpot_ms: Effect
    accept_length: Effect

    def to_json(self) -> dict[str, Any]:
        return {name: effect.to_json() for name, effect in vars(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Comparison | None:
        if data is None:
            return None
        return cls(**{name: Effect.from_json(entry) for name, entry in data.items()})


def _by_arm_json(comparisons: dict[str, Comparison]) -> dict[str, Any]:
    return {arm: c.to_json() for arm, c in comparisons.items()}


def _by_arm_from_json(data: dict[str, Any], key: str) -> dict[str, Comparison] | None:
    """``data[key]`` (arm -> comparison) rebuilt; None where the key is absent."""
    if key not in data:
        return None
    return {arm: Comparison.from_json(c) for arm, c in data[key].items()}


@dataclass
class SweepPoint:
    concurrency: int
    arms: dict[str, ArmMetrics]
    # The (first) arm under test against the baseline, both measured.
    comparison: Comparison | None = None
    # Several arms under test (ddtree-b15, ddtree-b64, ...): each one against the baseline,
    # by arm; None (and no "comparisons" key in the JSON) with one arm under test.
    comparisons: dict[str, Comparison] | None = None
    # --time-reference: every arm against the plain reference server, by arm; None (and no
    # "over_reference" key in the JSON) otherwise.
    over_reference: dict[str, Comparison] | None = None
    # Prompts per pass at this point when the points have their own counts (--num-prompts
    # given as a list, or defaults that differ by concurrency); None (and no "num_prompts"
    # key in the JSON) when one count, config.num_prompts, applies to every point.
    num_prompts: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"concurrency": self.concurrency}
        if self.num_prompts is not None:
            out["num_prompts"] = self.num_prompts
        out |= {
            "arms": {arm: m.to_json() for arm, m in self.arms.items()},
            "comparison": self.comparison.to_json() if self.comparison else None,
        }
        if self.comparisons is not None:
            out["comparisons"] = _by_arm_json(self.comparisons)
        if self.over_reference is not None:
            out["over_reference"] = _by_arm_json(self.over_reference)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweepPoint:
        return cls(
            concurrency=data["concurrency"],
            arms={arm: ArmMetrics.from_json(m) for arm, m in data["arms"].items()},
            comparison=Comparison.from_json(data["comparison"]),
            comparisons=_by_arm_from_json(data, "comparisons"),
            over_reference=_by_arm_from_json(data, "over_reference"),
            num_prompts=data.get("num_prompts"),
        )

    def compared(self, first: str) -> dict[str, Comparison]:
        """Arm under test -> its comparison with the baseline; ``first`` names the arm of
        ``comparison`` when there is only that one."""
        if self.comparisons is not None:
            return self.comparisons
        return {} if self.comparison is None else {first: self.comparison}


@dataclass
class RunConfig:
    dataset: str
    # One count for every point, or (per-point counts) one per point of ``concurrency``.
    num_prompts: int | list[int]
    max_new_tokens: int
    temperature: float
    concurrency: list[int]
    request_rate: float | None  # None: as fast as allowed
    trials: int
    warmup: int
    seed: int
    timeout_s: float
    max_error_rate: float

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunConfig:
        return cls(**data)


@dataclass
class Confounds:
    """Where the arms' ``/server_info`` differ in more than the algorithm."""

    differences: list[Difference] = field(default_factory=list)
    allowed: bool = False  # --allow-mismatch

    def to_json(self) -> dict[str, Any]:
        return {"differences": [d.to_json() for d in self.differences], "allowed": self.allowed}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Confounds:
        return cls([Difference.from_json(d) for d in data["differences"]], data["allowed"])


@dataclass
class Replica:
    """One server behind a router, as it answered ``/server_info``."""

    url: str
    server_info: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Replica:
        return cls(**data)


@dataclass
class RoutedArm:
    """An arm whose URL is a router: the router, and every replica it listed."""

    router: str  # the arm's URL
    router_info: dict[str, Any]  # the router's own /get_server_info summary
    replicas: list[Replica]
    # Among the replicas, where they run aside; values by replica URL (allowed only with
    # --allow-mismatch, like the arms' own differences).
    differences: list[Difference] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "router_info": self.router_info,
            "replicas": [r.to_json() for r in self.replicas],
            "differences": [d.to_json() for d in self.differences],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoutedArm:
        return cls(
            router=data["router"],
            router_info=data["router_info"],
            replicas=[Replica.from_json(r) for r in data["replicas"]],
            differences=[Difference.from_json(d) for d in data["differences"]],
        )


@dataclass
class ClientPass:
    """The client's own load during one pass (see :mod:`ddtree_cli.bench.monitor`)."""

    arm: str
    concurrency: int
    trial: int
    load: ClientLoad

    def to_json(self) -> dict[str, Any]:
        return {"arm": self.arm, "concurrency": self.concurrency, "trial": self.trial,
                **self.load.to_json()}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClientPass:
        lag = data["loop_lag_ms"]
        load = ClientLoad(
            cpu_fraction=data["cpu_fraction"],
            lag_p50_ms=lag["p50"],
            lag_p99_ms=lag["p99"],
            lag_max_ms=lag["max"],
            wall_s=data["wall_s"],
            warning=data["warning"],
        )
        return cls(data["arm"], data["concurrency"], data["trial"], load)


@dataclass
class Files:
    """The run folder's files, by name."""

    requests: str = "requests.jsonl"
    summary: str = "summary.json"
    report: str = "report.md"
    plots: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "plots": list(self.plots)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Files:
        return cls(**data)


@dataclass
class Summary:
    """A bench run. ``arms``, ``comparison`` (``comparisons`` with several arms under test) and
    ``headline_concurrency`` are the first sweep point's (the lowest concurrency asked for that
    was measured)."""

    tool: str
    status: RunStatus
    reason: str | None
    started: str
    finished: str
    algo: str
    baseline: str | None
    target: str  # "embedded" | "host" | "url"
    host: str | None
    switches: list[dict[str, Any]] | None  # --host: each deploy that switched the service
    urls: dict[str, str]
    reference: str | None
    config: RunConfig
    sweep: list[SweepPoint]
    lossless: LosslessResult
    confounds: Confounds
    # Per arm, as the server sent it; for an arm behind a router, its first replica's.
    server_info: dict[str, dict[str, Any]]
    client: list[ClientPass]
    warnings: list[str]
    errors: dict[str, int]  # failed requests per arm
    files: Files
    run_dir: str
    # Arms whose URL is a router; None (and no "replicas" key in the JSON) when there is none.
    replicas: dict[str, RoutedArm] | None = None

    @property
    def headline(self) -> SweepPoint | None:
        return self.sweep[0] if self.sweep else None

    @property
    def arms(self) -> dict[str, ArmMetrics]:
        return self.headline.arms if self.headline else {}

    @property
    def comparison(self) -> Comparison | None:
        return self.headline.comparison if self.headline else None

    @property
    def under_test(self) -> list[str]:
        """The measured arms other than the baseline, in run order."""
        names = dict.fromkeys(arm for point in self.sweep for arm in point.arms)
        return [arm for arm in names if arm not in (self.baseline, REFERENCE)]

    def compared(self, point: SweepPoint) -> dict[str, Comparison]:
        """Arm under test -> its comparison with the baseline at ``point``."""
        return point.compared(self.under_test[0] if self.under_test else self.algo)

    @property
    def headline_concurrency(self) -> int | None:
        return self.headline.concurrency if self.headline else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tool": self.tool,
            "status": self.status.value,
            "reason": self.reason,
            "started": self.started,
            "finished": self.finished,
            "algo": self.algo,
            "baseline": self.baseline,
            "target": self.target,
            "host": self.host,
            "switches": self.switches,
            "urls": self.urls,
            "reference": self.reference,
            "config": self.config.to_json(),
            "headline_concurrency": self.headline_concurrency,
            "arms": {arm: m.to_json() for arm, m in self.arms.items()},
            "comparison": self.comparison.to_json() if self.comparison else None,
        }
        if self.headline is not None and self.headline.comparisons is not None:
            out["comparisons"] = _by_arm_json(self.headline.comparisons)
        out |= {
            "sweep": [point.to_json() for point in self.sweep],
            "lossless": self.lossless.to_json(),
            "confounds": self.confounds.to_json(),
            "server_info": self.server_info,
            "client": [c.to_json() for c in self.client],
            "warnings": self.warnings,
            "errors": self.errors,
            "files": self.files.to_json(),
            "run_dir": self.run_dir,
        }
        if self.replicas is not None:
            out["replicas"] = {arm: routed.to_json() for arm, routed in self.replicas.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        return cls(
            tool=data["tool"],
            status=RunStatus(data["status"]),
            reason=data["reason"],
            started=data["started"],
            finished=data["finished"],
            algo=data["algo"],
            baseline=data["baseline"],
            target=data["target"],
            host=data["host"],
            switches=data["switches"],
            urls=data["urls"],
            reference=data["reference"],
            config=RunConfig.from_json(data["config"]),
            sweep=[SweepPoint.from_json(point) for point in data["sweep"]],
            lossless=LosslessResult.from_json(data["lossless"]),
            confounds=Confounds.from_json(data["confounds"]),
            server_info=data["server_info"],
            client=[ClientPass.from_json(c) for c in data["client"]],
            warnings=data["warnings"],
            errors=data["errors"],
            files=Files.from_json(data["files"]),
            run_dir=data["run_dir"],
            replicas={arm: RoutedArm.from_json(r) for arm, r in data["replicas"].items()}
            if "replicas" in data
            else None,
        )
