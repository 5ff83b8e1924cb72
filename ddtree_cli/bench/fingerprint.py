"""The confound guard: two arms must differ in the speculative algorithm and nothing else.

A fingerprint is a server's ``/server_info`` flattened to dotted keys, minus what changes
from one start to the next (ports, start time, live counters). Comparing two fingerprints
lists every other difference: model, weights, seed, GPU, versions, scheduling flags such as
``disable_overlap_schedule`` — each of which can decide an A/B on its own.

An arm behind a router is several replicas (see :mod:`ddtree_cli.bench.routers`): they must
be the same server but for where they run (:data:`PLACEMENT_KEYS`), and two such arms are
compared replica by replica.
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
# Where a replica runs rather than what it runs: the replicas of one arm may differ here, one
# GPU each (SGLang's --base-gpu-id, reported as base_gpu_id; hosts and ports are volatile).
PLACEMENT_KEYS = frozenset({"base_gpu_id", "gpu_id"})


# A plain server (the timed --reference) against speculative arms: besides the algorithm
# and every speculative_* setting, SGLang picks its default CUDA-graph batch sizes per mode
# (patched SGLang 0.5.13 on an H200, 2026-12-01, same flags: cuda_graph_bs [1, 2, 3, ..., 8]
# for DFLASH and DDTREE, [1, 2, 4, 8] for the plain server). From 0.5.14 the list it derives
# is cuda_graph_config.decode.bs (0.5.17 on an H100, 2026-12-05: [1, 2, ..., 8, 10, 12, ...]
# against [1, 2, 4, 8, 12, 16, 24, 32]); what the user sets, cuda_graph_bs_decode, is still
# compared. Keys as fingerprint() writes them (dotted for nested fields).
PLAIN_DERIVED_KEYS = frozenset({"cuda_graph_bs", "cuda_graph_config.decode.bs", DRAFTER_BLOCK_KEY})


@dataclass(frozen=True)
class Difference:
    key: str
    values: dict[str, Any]  # arm name -> value (None where the key is absent)

    def to_json(self) -> dict:
        return {"key": self.key, "values": self.values}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Difference:
        return cls(data["key"], data["values"])


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


def is_placement_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in PLACEMENT_KEYS


def compare(fingerprints: dict[str, dict[str, Any]]) -> list[Difference]:
    """Every non-algorithm key whose value is not the same on all arms."""
    return _differing(fingerprints, skip=is_algorithm_key)


def compare_with_plain(fingerprints: dict[str, dict[str, Any]]) -> list[Difference]:
    """:func:`compare` for a plain server among speculative ones: the speculative settings,
    which only the speculative servers have, and :data:`PLAIN_DERIVED_KEYS` aside."""

    def speculative(key: str) -> bool:
        leaf = key.rsplit(".", 1)[-1]
        return leaf.startswith("speculative_") or key in PLAIN_DERIVED_KEYS or is_algorithm_key(key)

    return _differing(fingerprints, skip=speculative)


def compare_replicas(fingerprints: dict[str, dict[str, Any]]) -> list[Difference]:
    """Within one arm (replica URL -> fingerprint): every key whose value is not the same on
    all replicas, placement and what the algorithm derives aside. The algorithm's own
    settings count here: one arm is one algorithm with one configuration."""
    return _differing(
        fingerprints,
        skip=lambda key: is_placement_key(key) or key.rsplit(".", 1)[-1] in DERIVED_KEYS,
    )


def compare_arms(replicas: dict[str, list[dict[str, Any]]]) -> list[Difference]:
    """Arm -> its replicas' fingerprints (one for a plain server): :func:`compare` on the
    replicas pair by pair, each arm's replicas in placement order. A difference seen in every
    pair is listed once; one seen in some pairs only is named with its pair ("(replica 2)").
    Arms with different numbers of replicas differ in ``replicas`` (capacity)."""
    arms = list(replicas)
    ordered = {arm: sorted(fps, key=_placement) for arm, fps in replicas.items()}
    counts = {arm: len(fps) for arm, fps in ordered.items()}
    diffs = [Difference("replicas", counts)] if len(set(counts.values())) > 1 else []
    pairs = [compare({arm: ordered[arm][i] for arm in arms}) for i in range(min(counts.values()))]
    if not pairs:
        return diffs
    everywhere = [d for d in pairs[0] if all(d in pair for pair in pairs[1:])]
    diffs += everywhere
    if len(pairs) > 1:
        for i, pair in enumerate(pairs, start=1):
            diffs += [Difference(f"{d.key} (replica {i})", d.values)
                      for d in pair if d not in everywhere]  # fmt: skip
    return diffs


def _placement(fp: dict[str, Any]) -> tuple[str, ...]:
    return tuple(repr(fp.get(key)) for key in sorted(k for k in fp if is_placement_key(k)))


def _differing(fingerprints: dict[str, dict[str, Any]], skip) -> list[Difference]:
    names = list(fingerprints)
    keys = sorted(set().union(*(fp.keys() for fp in fingerprints.values())))
    diffs = []
    for key in keys:
        if skip(key):
            continue
        values = {name: fingerprints[name].get(key) for name in names}
        if len({repr(v) for v in values.values()}) > 1:
            diffs.append(Difference(key, values))
    return diffs


def algorithm_of(server_info: dict[str, Any]) -> str | None:
    value = server_info.get("speculative_algorithm")
    return str(value) if value else None
