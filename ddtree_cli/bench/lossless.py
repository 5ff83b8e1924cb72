"""The lossless check: at temperature 0 a speculative decoder must emit the target's tokens.

Between arms: outputs for the same prompt are compared token for token and every
mismatch is listed with its first differing position. On the embedded engine (float32,
the same kernels in both arms) that must be exact. On GPUs, bf16 verify and decode
kernels round differently, so greedy outputs may flip at near-ties without any bug; there
a plain, non-speculative reference server decides: each arm's divergence rate against
it is measured, and an arm that diverges clearly more often than the other is flagged
(exact McNemar test on the prompts where only one arm diverged).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ddtree_cli.bench.stats import mcnemar_exact

FLAG_P = 0.05


@dataclass(frozen=True)
class Mismatch:
    prompt_id: str
    concurrency: int
    trial: int
    position: int
    tokens: dict[str, int | None]  # arm -> token at `position` (None: output ended)
    lengths: dict[str, int]

    def to_json(self) -> dict:
        return {
            "prompt_id": self.prompt_id,
            "concurrency": self.concurrency,
            "trial": self.trial,
            "position": self.position,
            "tokens": self.tokens,
            "lengths": self.lengths,
        }

    @classmethod
    def from_json(cls, data: dict) -> Mismatch:
        return cls(**data)


@dataclass
class ArmDivergence:
    """One arm against the reference server: on how many prompts any output differs."""

    compared: int
    diverged: int
    rate: float | None
    prompts: list[str]

    def to_json(self) -> dict:
        return {"compared": self.compared, "diverged": self.diverged, "rate": self.rate,
                "prompts": self.prompts}  # fmt: skip


@dataclass
class ReferenceDivergence:
    arms: dict[str, ArmDivergence]
    flagged: list[str] = field(default_factory=list)  # an arm that diverges clearly more often
    p_value: float | None = None  # exact McNemar, two arms only
    discordant: dict[str, int] | None = None  # per arm: prompts where only it diverged
    # several arms under test: each one's McNemar p against the baseline (Holm-corrected)
    p_values: dict[str, float] | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"arms": {arm: d.to_json() for arm, d in self.arms.items()},
                               "flagged": self.flagged, "p_value": self.p_value}  # fmt: skip
        if self.discordant is not None:
            out["discordant"] = self.discordant
        if self.p_values is not None:
            out["p_values"] = self.p_values
        return out

    @classmethod
    def from_json(cls, data: dict | None) -> ReferenceDivergence | None:
        if data is None:
            return None
        arms = {arm: ArmDivergence(**d) for arm, d in data["arms"].items()}
        return cls(arms, data["flagged"], data["p_value"], data.get("discordant"),
                   data.get("p_values"))  # fmt: skip


SKIPPED = "needs two arms at temperature 0, or --reference"


@dataclass
class LosslessResult:
    arms: tuple[str, ...]
    strict: bool
    compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    reference: ReferenceDivergence | None = None
    skipped: str | None = None  # why no check ran

    @classmethod
    def not_run(cls, reason: str = SKIPPED) -> LosslessResult:
        return cls((), strict=False, skipped=reason)

    @property
    def flagged(self) -> list[str]:
        return list(self.reference.flagged) if self.reference else []

    @property
    def ok(self) -> bool | None:
        """None when no check ran."""
        if self.skipped:
            return None
        if self.flagged:
            return False
        return not (self.strict and self.mismatches)

    @property
    def mismatch_rate(self) -> float | None:
        return (len(self.mismatches) / self.compared) if self.compared else None

    def to_json(self) -> dict:
        if self.skipped:
            return {"compared": self.compared, "mismatches": [], "ok": None,
                    "skipped": self.skipped}  # fmt: skip
        return {
            "arms": list(self.arms),
            "strict": self.strict,
            "compared": self.compared,
            "mismatches": [m.to_json() for m in self.mismatches],
            "mismatch_rate": self.mismatch_rate,
            "reference": self.reference.to_json() if self.reference else None,
            "ok": self.ok,
        }

    @classmethod
    def from_json(cls, data: dict) -> LosslessResult:
        if data.get("skipped"):
            return cls((), strict=False, compared=data["compared"], skipped=data["skipped"])
        return cls(
            tuple(data["arms"]),
            data["strict"],
            data["compared"],
            [Mismatch.from_json(m) for m in data["mismatches"]],
            ReferenceDivergence.from_json(data["reference"]),
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _outputs(records: Iterable[dict[str, Any]], arm: str) -> dict[tuple, list[int]]:
    return {
        (r["concurrency"], r["trial"], r["prompt_id"]): r["output_ids"]
        for r in records
        if r["arm"] == arm and r["ok"] and r.get("output_ids") is not None
    }


def compare_arms(
    records: list[dict[str, Any]], arm_a: str, arm_b: str, *, strict: bool
) -> LosslessResult:
    out = LosslessResult((arm_a, arm_b), strict)
    a, b = _outputs(records, arm_a), _outputs(records, arm_b)
    for key in sorted(a.keys() & b.keys()):
        out.compared += 1
        pos = first_difference(a[key], b[key])
        if pos is None:
            continue
        conc, trial, pid = key
        out.mismatches.append(
            Mismatch(
                pid,
                conc,
                trial,
                pos,
                {arm_a: _at(a[key], pos), arm_b: _at(b[key], pos)},
                {arm_a: len(a[key]), arm_b: len(b[key])},
            )
        )
    return out


def _at(ids: list[int], pos: int) -> int | None:
    return ids[pos] if pos < len(ids) else None


def reference_divergence(
    records: list[dict[str, Any]], reference: dict[str, list[int]], arms: list[str]
) -> ReferenceDivergence:
    """Per arm: on how many prompts any of its outputs differs from the reference's."""
    diverged: dict[str, dict[str, bool]] = {arm: {} for arm in arms}
    for r in records:
        if r["arm"] not in diverged or not r["ok"] or r.get("output_ids") is None:
            continue
        ref = reference.get(r["prompt_id"])
        if ref is None:
            continue
        bad = first_difference(r["output_ids"], ref) is not None
        seen = diverged[r["arm"]]
        seen[r["prompt_id"]] = seen.get(r["prompt_id"], False) or bad
    per_arm = {
        arm: ArmDivergence(
            compared=len(d),
            diverged=sum(d.values()),
            rate=(sum(d.values()) / len(d)) if d else None,
            prompts=sorted(p for p, bad in d.items() if bad),
        )
        for arm, d in diverged.items()
    }
    out = ReferenceDivergence(per_arm)
    if len(arms) == 2:
        x, y = arms
        common = diverged[x].keys() & diverged[y].keys()
        only_x = sum(1 for p in common if diverged[x][p] and not diverged[y][p])
        only_y = sum(1 for p in common if diverged[y][p] and not diverged[x][p])
        p = mcnemar_exact(only_x, only_y)
        out.p_value = p
        out.discordant = {x: only_x, y: only_y}
        if p < FLAG_P:
            out.flagged = [x if only_x > only_y else y]
    return out


def against_baseline(
    records: list[dict[str, Any]],
    reference: dict[str, list[int]],
    arms: list[str],
    under_test: list[str],
    baseline: str,
) -> ReferenceDivergence:
    """Every arm's divergence from the reference, and McNemar's test of each arm under test
    against the baseline, the p-values Holm-corrected for their number: with three arms
    under test, three tests at 0.05 each would flag some pair in one run of seven by chance
    (a GPU run at concurrency 32 flagged DFLASH against one of three DDTREE arms at
    p = 0.017). An arm is flagged where its pair's corrected p is below ``FLAG_P``: the
    arm under test or the baseline, whichever diverged on more of the discordant prompts."""
    out = reference_divergence(records, reference, arms)
    pairs = {arm: reference_divergence(records, reference, [arm, baseline]) for arm in under_test}
    out.p_values = {arm: pair.p_value for arm, pair in pairs.items()}
    ordered = sorted(pairs, key=lambda arm: pairs[arm].p_value)
    for rank, arm in enumerate(ordered):  # Holm: the j-th smallest against FLAG_P / (k - j)
        pair = pairs[arm]
        if pair.p_value >= FLAG_P / (len(ordered) - rank):
            break
        only = pair.discordant or {}
        worse = arm if only.get(arm, 0) > only.get(baseline, 0) else baseline
        if worse not in out.flagged:
            out.flagged.append(worse)
    return out
