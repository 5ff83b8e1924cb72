"""What an A/B's two arms must share: a fingerprint per host, the keys on which hosts
differ, and the ``ab.fairness`` verdict."""

from __future__ import annotations

from collections.abc import Callable

from ddtree_cli.doctor.verdict import Verdict, passed, skipped, warned

_FINGERPRINT: list[tuple[str, Callable[[dict], str | None]]] = [
    (
        "gpu",
        lambda f: (
            ", ".join(
                sorted(
                    f"{sum(1 for g in f['nvidia_smi']['gpus'] if g.get('name') == n)}× {n}"
                    for n in {g.get("name") for g in (f.get("nvidia_smi") or {}).get("gpus") or []}
                )
            )
            or None
        ),
    ),
    (
        "compute capability",
        lambda f: (
            ", ".join(
                sorted(
                    {
                        g.get("compute_cap") or "?"
                        for g in (f.get("nvidia_smi") or {}).get("gpus") or []
                    }
                )
            )
            or None
        ),
    ),
    ("driver", lambda f: (f.get("nvidia_smi") or {}).get("driver_version")),
    ("python", lambda f: (f.get("python") or {}).get("version")),
    ("torch", lambda f: (f.get("torch") or {}).get("version")),
    ("torch CUDA", lambda f: (f.get("torch") or {}).get("cuda")),
    ("nvcc", lambda f: (f.get("nvcc") or {}).get("release")),
]
_FINGERPRINT_PACKAGES = (
    "sglang",
    "sglang-kernel",
    "sgl-kernel",
    "flashinfer-python",
    "flashinfer-cubin",
    "flashinfer-jit-cache",
    "triton",
    "transformers",
)


def fingerprint(facts: dict) -> dict[str, str | None]:
    """What an A/B's two arms must share, per host."""
    result: dict[str, str | None] = {}
    for key, read in _FINGERPRINT:
        try:
            result[key] = read(facts)
        except (KeyError, TypeError):
            result[key] = None
    packages = facts.get("packages") or {}
    for name in _FINGERPRINT_PACKAGES:
        result[name] = packages.get(name)
    env = facts.get("env") or {}
    result["FLASHINFER_DISABLE_VERSION_CHECK"] = env.get("FLASHINFER_DISABLE_VERSION_CHECK")
    return result


def differences(facts_by_host: dict[str, dict]) -> list[dict]:
    """[{"key", "values": {host: value}}] for every fingerprint key on which hosts differ."""
    prints = {host: fingerprint(facts) for host, facts in facts_by_host.items()}
    rows = []
    keys = next(iter(prints.values())).keys() if prints else []
    for key in keys:
        values = {host: fp.get(key) for host, fp in prints.items()}
        if len(set(values.values())) > 1:
            rows.append({"key": key, "values": values})
    return rows


def check_fairness(diffs: list[dict], hosts: list[str]) -> Verdict:
    if len(hosts) < 2:
        return skipped("ab.fairness", "one host")
    if not diffs:
        return passed("ab.fairness", f"{len(hosts)} hosts share GPU, driver, torch and kernels")
    keys = ", ".join(row["key"] for row in diffs)
    return warned(
        "ab.fairness",
        f"hosts differ in {keys}: an A/B across them measures the hosts, not the algorithm",
        "run both arms on one host, or on hosts whose difference table is empty",
    )
