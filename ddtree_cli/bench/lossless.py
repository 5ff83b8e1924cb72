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
            "prompt_id": self.prompt_id, "concurrency": self.concurrency, "trial": self.trial,
            "position": self.position, "tokens": self.tokens, "lengths": self.lengths,
        }


@dataclass
class LosslessResult:
    arms: tuple[str, ...]
    strict: bool
    compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    reference: dict[str, Any] | None = None

    @property
    def flagged(self) -> list[str]:
        return list((self.reference or {}).get("flagged", []))

    @property
    def ok(self) -> bool:
        if self.flagged:
            return False
        return not (self.strict and self.mismatches)

    def to_json(self) -> dict:
        return {
            "arms": list(self.arms),
            "strict": self.strict,
            "compared": self.compared,
            "mismatches": [m.to_json() for m in self.mismatches],
            "mismatch_rate": (len(self.mismatches) / self.compared) if self.compared else None,
            "reference": self.reference,
            "ok": self.ok,
        }


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
                pid, conc, trial, pos,
                {arm_a: _at(a[key], pos), arm_b: _at(b[key], pos)},
                {arm_a: len(a[key]), arm_b: len(b[key])},
            )
        )
    return out


def _at(ids: list[int], pos: int) -> int | None:
    return ids[pos] if pos < len(ids) else None


def reference_divergence(
    records: list[dict[str, Any]], reference: dict[str, list[int]], arms: list[str]
) -> dict[str, Any]:
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
        arm: {
            "compared": len(d),
            "diverged": sum(d.values()),
            "rate": (sum(d.values()) / len(d)) if d else None,
            "prompts": sorted(p for p, bad in d.items() if bad),
        }
        for arm, d in diverged.items()
    }
    out: dict[str, Any] = {"arms": per_arm, "flagged": [], "p_value": None}
    if len(arms) == 2:
        x, y = arms
        common = diverged[x].keys() & diverged[y].keys()
        only_x = sum(1 for p in common if diverged[x][p] and not diverged[y][p])
        only_y = sum(1 for p in common if diverged[y][p] and not diverged[x][p])
        p = mcnemar_exact(only_x, only_y)
        out["p_value"] = p
        out["discordant"] = {x: only_x, y: only_y}
        if p < FLAG_P:
            out["flagged"] = [x if only_x > only_y else y]
    return out
