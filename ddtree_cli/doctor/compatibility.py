"""The compatibility rule set, in display order: what ``doctor`` and ``deploy``'s preflight
both run over a host's facts (and the snapshot to be served, where it matters)."""

from __future__ import annotations

from collections.abc import Callable

from ddtree_cli.doctor.cuda_rules import (
    check_cuda_available,
    check_cuda_packages,
    check_driver_present,
    check_driver_vs_torch,
    check_gpu_arch,
    check_nvcc,
    check_torch_cuda_build,
    check_torch_installed,
)
from ddtree_cli.doctor.kernel_rules import (
    check_flashinfer_version_check_env,
    check_flashinfer_versions,
    check_jit_cache,
    check_probe,
    check_sglang_pins,
)
from ddtree_cli.doctor.snapshot_abi import SnapshotABI
from ddtree_cli.doctor.snapshot_rules import (
    check_python_abi,
    check_python_version,
    check_sglang_vs_snapshot,
)
from ddtree_cli.doctor.verdict import Verdict


def _probe_check(module: str) -> Callable[[dict], Verdict]:
    def rule(facts: dict) -> Verdict:
        return check_probe(facts, module)

    rule.__name__ = f"check_probe_{module}"
    return rule


# Rules over facts alone, in display order; snapshot rules take (facts, snapshot).
ABI_CHECKS: list[Callable[[dict], Verdict]] = [
    check_torch_installed,
    check_torch_cuda_build,
    check_driver_present,
    check_driver_vs_torch,
    check_cuda_available,
    check_gpu_arch,
    check_nvcc,
    check_cuda_packages,
    check_flashinfer_versions,
    check_jit_cache,
    check_flashinfer_version_check_env,
    check_sglang_pins,
    _probe_check("sgl_kernel"),
    _probe_check("flashinfer"),
    _probe_check("sglang"),
]
SNAPSHOT_CHECKS: list[Callable[[dict, SnapshotABI | None], Verdict]] = [
    check_python_version,
    check_python_abi,
    check_sglang_vs_snapshot,
]


def run_abi_checks(facts: dict, snapshot: SnapshotABI | None = None) -> list[Verdict]:
    """Every compatibility rule, in order: python first, then torch/GPU, then packages."""
    first = [rule(facts, snapshot) for rule in SNAPSHOT_CHECKS[:2]]
    return first + [rule(facts) for rule in ABI_CHECKS] + [SNAPSHOT_CHECKS[2](facts, snapshot)]
