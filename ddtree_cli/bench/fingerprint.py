"""The confound guard: two arms must differ in the speculative algorithm and nothing else.

A fingerprint is a server's ``/server_info`` flattened to dotted keys, minus what changes
from one start to the next (ports, start time, live counters). Comparing two fingerprints
lists every other difference: model, weights, seed, GPU, versions, scheduling flags such as
``disable_overlap_schedule`` — each of which can decide an A/B on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Differ between any two server starts, say nothing about the configuration.
VOLATILE_KEYS = frozenset(
    {
        "host",
        "port",
        "startup_time",
        "internal_states",
        "pid",
        "status",
        "load",
        "nccl_port",
        "dist_init_addr",
        "metrics_http_port",
        "uptime_s",
        "url",
    }
)
# What legitimately differs between the arms of an algorithm A/B: the algorithm, and DDTREE's
# own settings (speculative_ddtree_budget, speculative_ddtree_allow_hybrid, ...).
ALGORITHM_KEYS = frozenset({"speculative_algorithm", "algo", "algorithm"})
ALGORITHM_MARKERS = ("ddtree",)
# The two widths SGLang reports mean different things per algorithm (patched SGLang 0.5.13 on
# an H200, 2026-12-01, from identical flags but the algorithm): DFLASH drafts and verifies
# one block, reported as speculative_num_draft_tokens=16 with speculative_dflash_block_size
# null; DDTREE keeps the drafter's block in speculative_dflash_block_size=16 and verifies the
# root plus its budget, speculative_num_draft_tokens=65 for budget 64. So the fingerprint
# compares the drafter's block under one key, DRAFTER_BLOCK_KEY, instead of the raw widths;
# DDTREE's verify width follows from its budget, an algorithm setting.
WIDTH_KEYS = ("speculative_num_draft_tokens", "speculative_dflash_block_size")
DRAFTER_BLOCK_KEY = "drafter_block_size"
# Outcomes of the algorithm rather than settings: SGLang sizes its KV pool from the memory left
# after the weights, the draft model and the algorithm's own buffers, so a DDTREE server gets
# a smaller pool than a DFLASH one from identical flags (seen on an H200: 5,188,790 vs
# 6,582,151 tokens at --mem-fraction-static 0.2). A smaller pool is part of what the
# algorithm costs, so it is not held against the A/B.
DERIVED_KEYS = frozenset({"max_total_num_tokens"})


@dataclass(frozen=True)
class Difference:
    key: str
    values: dict[str, Any]  # arm name -> value (None where the key is absent)

    def to_json(self) -> dict:
        return {"key": self.key, "values": self.values}


def fingerprint(server_info: dict[str, Any]) -> dict[str, Any]:
    """Flatten ``/server_info`` into comparable dotted keys, the speculative widths replaced
    by the drafter's block (see :data:`WIDTH_KEYS`) for DFLASH and DDTREE servers."""
    flat: dict[str, Any] = {}
    _flatten(server_info, "", flat)
    algorithm = (algorithm_of(server_info) or "").upper()
    if algorithm in ("DFLASH", "DDTREE"):
        for key in WIDTH_KEYS:
            flat.pop(key, None)
        flat[DRAFTER_BLOCK_KEY] = drafter_block(server_info)
    return flat


def drafter_block(server_info: dict[str, Any]) -> int | None:
    """The block the DFlash drafter drafts per round; None where the server does not say
    (a DDTREE server patched before it reported speculative_dflash_block_size)."""
    algorithm = (algorithm_of(server_info) or "").upper()
    if algorithm == "DDTREE":
        return server_info.get("speculative_dflash_block_size")
    if algorithm == "DFLASH":
        return server_info.get("speculative_num_draft_tokens")
    return None


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in VOLATILE_KEYS or key.endswith("_port"):
                continue
            _flatten(value, f"{prefix}{key}.", out)
        return
    out[prefix[:-1]] = obj


def is_algorithm_key(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    if leaf.startswith("speculative_ddtree_") or leaf in ALGORITHM_KEYS or leaf in DERIVED_KEYS:
        return True
    return any(m in leaf.lower() for m in ALGORITHM_MARKERS)


def compare(fingerprints: dict[str, dict[str, Any]]) -> list[Difference]:
    """Every non-algorithm key whose value is not the same on all arms."""
    arms = list(fingerprints)
    keys = sorted(set().union(*(fp.keys() for fp in fingerprints.values())))
    diffs = []
    for key in keys:
        if is_algorithm_key(key):
            continue
        values = {arm: fingerprints[arm].get(key) for arm in arms}
        if len({repr(v) for v in values.values()}) > 1:
            diffs.append(Difference(key, values))
    return diffs


def algorithm_of(server_info: dict[str, Any]) -> str | None:
    value = server_info.get("speculative_algorithm")
    return str(value) if value else None
