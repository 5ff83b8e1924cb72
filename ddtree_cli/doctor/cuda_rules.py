"""Rules over the CUDA stack: torch and its CUDA build, the NVIDIA driver, the GPU's
architecture, nvcc, the CUDA wheels in the serving venv, and persistence mode.

Rules that depend on something absent say so: with no NVIDIA driver only ``gpu.driver``
fails, and the GPU rules behind it skip with that reason, so the root cause stands out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddtree_cli.doctor.parsing import (
    arch_entries,
    base_version,
    capability_tuple,
    driver_label,
    local_cuda_major,
    no_driver_reason,
    normalise_name,
    pip_install,
    sglang_pins,
    sm_label,
    torch_cuda_major,
    torch_missing_reason,
    version_tuple,
)
from ddtree_cli.doctor.verdict import Verdict, failed, passed, skipped, warned

# Minimum Linux driver per CUDA major (NVIDIA's CUDA toolkit release notes, "CUDA Toolkit
# and Corresponding Driver Versions"; minor-version compatibility within a major).
MIN_DRIVER_FOR_CUDA_MAJOR: dict[int, tuple[int, ...]] = {
    11: (450, 80, 2),
    12: (525, 60, 13),
    13: (580, 65, 6),
}

# First CUDA release whose toolchain builds SASS for a compute capability; used to name the
# torch build (and nvcc) a GPU needs.
MIN_CUDA_FOR_CAPABILITY: dict[tuple[int, int], tuple[int, int]] = {
    (8, 0): (11, 0),
    (8, 6): (11, 1),
    (8, 9): (11, 8),
    (9, 0): (11, 8),
    (10, 0): (12, 8),
    (10, 3): (12, 9),
    (12, 0): (12, 8),
    (12, 1): (12, 9),
}

TORCH_INDEX = "https://download.pytorch.org/whl"

# Which CUDA release an unsuffixed NVIDIA wheel belongs to. Since CUDA 11 each component is
# versioned on its own (NVIDIA's CUDA Toolkit Release Notes, section "CUDA Toolkit Major
# Components", e.g. https://docs.nvidia.com/cuda/archive/13.0.0/cuda-toolkit-release-notes/
# index.html, Table 1 "CUDA 13.0 Component Versions"), so a library's version is not the CUDA
# major: CUDA 13.0 Update 2 ships cuBLAS 13.1.0.3, cuFFT 12.0.0.61, cuRAND 10.4.0.35, cuSOLVER
# 12.0.4.66, cuSPARSE 12.6.3.3, nvJitLink 13.0.88. The ranges below are the component versions
# of every CUDA 12.x and 13.x release as NVIDIA's own package channel labels them per release
# (https://anaconda.org/nvidia/libcufft/labels, .../libcurand, .../libcusolver,
# .../libcusparse, read 2026-12-01), checked against the pins of the real cuda-toolkit 13.0.2 /
# 13.0.3 and torch 2.9.1 (cu128) wheels. A version outside every range is "not in the table"
# and proves nothing; torch's own pins (its Requires-Dist) decide first.
# component: [(lowest version prefix, highest version prefix, CUDA major)]
CUDA_COMPONENT_RANGES: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]] = {
    "cufft": [((11, 0), (11, 4), 12), ((12, 0), (12, 1), 13)],
    "curand": [((10, 3, 1), (10, 3), 12), ((10, 4), (10, 4), 13)],
    "cusolver": [((11, 4), (11, 7), 12), ((12, 0), (12, 2), 13)],
    "cusparse": [((12, 0), (12, 5), 12), ((12, 6), (12, 7), 13)],
}
# Components whose major version is the CUDA major in every 12.x and 13.x release (cuBLAS
# 12.8.4.1 in 12.8 Update 1, 13.1.0.3 in 13.0 Update 2; cudart, NVRTC, CUPTI, NVTX, nvJitLink,
# NPP and nvJPEG 13.0.x in 13.0).
_SAME_MAJOR_COMPONENTS = re.compile(r"^(cublas|cuda-[a-z-]+|nvjitlink|nvtx|npp|nvjpeg)$")


def check_torch_installed(facts: dict) -> Verdict:
    torch = facts.get("torch") or {}
    pin = sglang_pins(facts).get("torch")
    spec = f"torch=={pin}" if pin else "torch"
    if torch.get("installed") is False:
        return failed("torch.installed", "torch is not installed", f"{pip_install(facts)} '{spec}'")
    if torch.get("installed") is None or not torch.get("version"):
        return failed(
            "torch.installed",
            f"importing torch failed: {torch.get('error') or 'unknown error'}",
            f"{pip_install(facts)} --force-reinstall '{spec}'",
        )
    return passed("torch.installed", f"torch {torch['version']}")


def check_torch_cuda_build(facts: dict) -> Verdict:
    missing = torch_missing_reason(facts)
    if missing:
        return skipped("torch.cuda_build", missing)
    torch = facts["torch"]
    if torch.get("hip"):
        return failed(
            "torch.cuda_build",
            f"torch {torch['version']} is a ROCm build; this stack needs CUDA",
            f"{pip_install(facts)} 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu130",
        )
    if not torch.get("cuda"):
        return failed(
            "torch.cuda_build",
            f"torch {torch['version']} is a CPU-only build",
            f"{pip_install(facts)} --force-reinstall 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu{_suggested_cuda_tag(facts)}",
        )
    return passed("torch.cuda_build", f"torch {torch['version']} built for CUDA {torch['cuda']}")


def _suggested_cuda_tag(facts: dict) -> str:
    """cu130 when the driver can run CUDA 13 (or is unknown), else cu128."""
    driver_cuda = version_tuple((facts.get("nvidia_smi") or {}).get("cuda_version"))
    return "128" if driver_cuda and driver_cuda < (13, 0) else "130"


def check_driver_present(facts: dict) -> Verdict:
    reason = no_driver_reason(facts)
    if reason:
        major = torch_cuda_major(facts) or 13
        minimum = ".".join(map(str, MIN_DRIVER_FOR_CUDA_MAJOR.get(major, (580,))[:2]))
        return failed(
            "gpu.driver",
            reason,
            f"install the NVIDIA driver (>= {minimum} for CUDA {major}) and reboot; "
            "check with nvidia-smi",
        )
    smi = facts["nvidia_smi"]
    gpus = smi.get("gpus") or []
    if not gpus:
        return failed(
            "gpu.driver",
            f"driver {smi['driver_version']} sees no GPU",
            "check that the GPUs are attached (lspci | grep -i nvidia) and the module is "
            "loaded (nvidia-smi -L)",
        )
    names = sorted({g.get("name") or "?" for g in gpus})
    return passed(
        "gpu.driver",
        f"driver {driver_label(smi)}, {len(gpus)} × {', '.join(names)}",
    )


def check_driver_vs_torch(facts: dict) -> Verdict:
    reason = no_driver_reason(facts) or torch_missing_reason(facts)
    if reason:
        return skipped("gpu.driver_cuda", reason)
    torch = facts["torch"]
    needed = version_tuple(torch.get("cuda"))
    if not needed:
        return skipped("gpu.driver_cuda", f"torch {torch['version']} has no CUDA build")
    smi = facts["nvidia_smi"]
    driver = version_tuple(smi.get("driver_version"))
    minimum = MIN_DRIVER_FOR_CUDA_MAJOR.get(needed[0])
    driver_cuda = version_tuple(smi.get("cuda_version"))
    too_old = (driver_cuda and driver_cuda[0] < needed[0]) or (
        not driver_cuda and minimum and driver < minimum
    )
    if too_old:
        alt = "cu128" if needed[0] >= 13 else "an older CUDA"
        return failed(
            "gpu.driver_cuda",
            f"driver {smi['driver_version']} supports CUDA {smi.get('cuda_version') or '?'}, "
            f"torch {torch['version']} needs CUDA {torch['cuda']}",
            f"upgrade the NVIDIA driver to >= {'.'.join(map(str, (minimum or (0,))[:2]))} or "
            f"install a {alt} build of torch ({TORCH_INDEX}/{alt if alt.startswith('cu') else ''})",
        )
    if driver_cuda and driver_cuda < needed:
        return warned(
            "gpu.driver_cuda",
            f"driver supports CUDA {smi['cuda_version']} < torch's {torch['cuda']}: runs by "
            "minor-version compatibility, but PTX JIT (Triton, FlashInfer) may fail",
            f"upgrade the NVIDIA driver to one that reports CUDA >= {torch['cuda']}",
        )
    return passed(
        "gpu.driver_cuda",
        f"driver {driver_label(smi)} >= torch CUDA {torch['cuda']}",
    )


def check_cuda_available(facts: dict) -> Verdict:
    reason = no_driver_reason(facts) or torch_missing_reason(facts)
    if reason:
        return skipped("torch.cuda_available", reason)
    torch = facts["torch"]
    if not torch.get("cuda"):
        return skipped("torch.cuda_available", f"torch {torch['version']} has no CUDA build")
    if torch.get("cuda_available"):
        return passed("torch.cuda_available", f"torch sees {torch.get('device_count')} GPU(s)")
    said = " ".join(torch.get("warnings") or [])[:300]
    return failed(
        "torch.cuda_available",
        "torch.cuda.is_available() is False"
        + (f": {said}" if said else "")
        + " (SGLang would fall back to 'Auto-configed device: cpu')",
        "fix gpu.driver_cuda first; otherwise check /dev/nvidia* permissions and "
        "CUDA_VISIBLE_DEVICES",
    )


def check_gpu_arch(facts: dict) -> Verdict:
    """Every GPU's compute capability must have SASS (or older PTX) in torch's arch list."""
    reason = no_driver_reason(facts) or torch_missing_reason(facts)
    if reason:
        return skipped("gpu.arch", reason)
    torch = facts["torch"]
    if not torch.get("cuda"):
        return skipped("gpu.arch", f"torch {torch['version']} has no CUDA build")
    arch_list = torch.get("arch_list") or []
    if not arch_list:
        return skipped("gpu.arch", "torch did not report its arch list")
    entries = arch_entries(arch_list)
    caps = {}
    for gpu in facts["nvidia_smi"].get("gpus") or []:
        cap = capability_tuple(gpu.get("compute_cap"))
        if cap:
            caps.setdefault(cap, gpu.get("name") or "?")
    if not caps:
        return skipped("gpu.arch", "nvidia-smi did not report compute capabilities")
    jit_only, missing = [], []
    for cap, name in sorted(caps.items()):
        # SASS runs on the same major at an equal or higher minor; PTX JITs forward.
        if any(k == "sm" and c[0] == cap[0] and c[1] <= cap[1] for k, c in entries):
            continue
        if any(k == "compute" and c <= cap for k, c in entries):
            jit_only.append(f"{name} ({sm_label(cap)})")
        else:
            missing.append((cap, name))
    if missing:
        cap, name = missing[0]
        need = MIN_CUDA_FOR_CAPABILITY.get(cap)
        build = f"cu{need[0]}{need[1]}" if need else "a newer CUDA"
        return failed(
            "gpu.arch",
            f"{name} is {sm_label(cap)}; torch {torch['version']} supports {' '.join(arch_list)}",
            f"install a torch build with {sm_label(cap)} ({build} or newer): "
            f"{pip_install(facts)} --force-reinstall 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu{_suggested_cuda_tag(facts)}",
        )
    if jit_only:
        return warned(
            "gpu.arch",
            f"only PTX for {', '.join(jit_only)}: kernels JIT-compile at first use (slow start)",
            "install a torch build with SASS for that architecture",
        )
    return passed(
        "gpu.arch", f"{', '.join(sm_label(c) for c in sorted(caps))} in torch's arch list"
    )


def check_nvcc(facts: dict) -> Verdict:
    """FlashInfer/DeepGEMM JIT with a host nvcc of another CUDA major caches broken kernels."""
    major = torch_cuda_major(facts)
    missing = torch_missing_reason(facts)
    if missing or major is None:
        return skipped("cuda.nvcc", missing or "torch has no CUDA build")
    nvcc = facts.get("nvcc") or {}
    if not nvcc.get("present"):
        return warned(
            "cuda.nvcc",
            "nvcc not found: JIT kernels (FlashInfer, DeepGEMM) cannot be built on this host",
            f"install the CUDA {major} toolkit and set CUDA_HOME, or install flashinfer-jit-cache",
        )
    release = version_tuple(nvcc.get("release"))
    if not release:
        return warned("cuda.nvcc", f"could not read nvcc's release ({nvcc.get('path')})")
    if release[0] != major:
        return failed(
            "cuda.nvcc",
            f"nvcc {nvcc['release']} ({nvcc['path']}) but torch is built for CUDA {major}: "
            "JIT-built kernels then fail with cudaErrorInsufficientDriver",
            f"set CUDA_HOME to a CUDA {major}.x toolkit, then rm -rf ~/.cache/flashinfer",
        )
    caps = [
        capability_tuple(g.get("compute_cap"))
        for g in (facts.get("nvidia_smi") or {}).get("gpus") or []
    ]
    for cap in caps:
        need = MIN_CUDA_FOR_CAPABILITY.get(cap) if cap else None
        if need and release < need:
            return failed(
                "cuda.nvcc",
                f"nvcc {nvcc['release']} cannot build for {sm_label(cap)} (needs {need[0]}.{need[1]}+)",
                f"install CUDA toolkit >= {need[0]}.{need[1]} and point CUDA_HOME at it",
            )
    return passed("cuda.nvcc", f"nvcc {nvcc['release']} matches torch's CUDA {major}")


def _in_range(version: tuple[int, ...], low: tuple[int, ...], high: tuple[int, ...]) -> bool:
    return version[: len(low)] >= low and version[: len(high)] <= high


def component_cuda_major(name: str, version: str) -> int | None:
    """CUDA major of an unsuffixed NVIDIA wheel from NVIDIA's component table; None when the
    name or version is not in it (nvidia-ml-py, nccl, cuDNN, cuFile number themselves)."""
    component = name.removeprefix("nvidia-")
    have = version_tuple(version)
    if not name.startswith("nvidia-") or not have:
        return None
    if _SAME_MAJOR_COMPONENTS.match(component):
        return have[0] if have[0] in (12, 13) else None
    for low, high, major in CUDA_COMPONENT_RANGES.get(component, []):
        if _in_range(have, low, high):
            return major
    return None


def _requirement_specs(lines: list[str], extras: set[str] | None = None) -> dict[str, str]:
    """{normalised name: version spec} of Requires-Dist lines whose marker is Linux or none,
    keeping extras only when ``extras`` names them ("nvidia-cublas==13.1.0.3.*" -> "13.1.0.3")."""
    specs = {}
    for line in lines:
        requirement, _, marker = line.partition(";")
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if extra and (extras is None or extra.group(1) not in extras):
            continue
        if "sys_platform" in marker and "linux" not in marker:
            continue
        if "platform_system" in marker and "Linux" not in marker:
            continue
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[([^\]]*)\])?\s*(.*)$", requirement)
        if match:
            spec = match.group(4).strip()
            specs[normalise_name(match.group(1))] = spec
            if extra is None and match.group(3) is not None:
                specs[f"{normalise_name(match.group(1))}[]"] = match.group(3)
    return specs


def _spec_version(spec: str) -> str | None:
    match = re.match(r"^==\s*([0-9][0-9A-Za-z.]*?)(\.\*)?$", spec.strip())
    return match.group(1) if match else None


def torch_own_pins(facts: dict) -> dict[str, str]:
    """The NVIDIA wheels the installed torch declares, {name: exact version}: its own
    Requires-Dist (nvidia-cudnn-cu13==9.19.0.56, ...) plus, for CUDA 13 builds, the pins of the
    cuda-toolkit extras it asks for (cuda-toolkit[cublas,...]==13.0.2 -> nvidia-cublas
    13.1.0.3.*, ...), read from the installed cuda-toolkit's Requires-Dist."""
    requires = facts.get("requires") or {}
    torch_specs = _requirement_specs(requires.get("torch") or [])
    pins = {
        n: v for n, spec in torch_specs.items() if n.startswith("nvidia-") and
        (v := _spec_version(spec))
    }  # fmt: skip
    extras = torch_specs.get("cuda-toolkit[]")
    if extras is not None and requires.get("cuda-toolkit"):
        wanted = {e.strip() for e in extras.split(",") if e.strip()}
        for name, spec in _requirement_specs(requires["cuda-toolkit"], wanted).items():
            version = _spec_version(spec)
            if name.startswith("nvidia-") and version:
                pins[name] = version
    return pins


@dataclass(frozen=True)
class CudaPackage:
    name: str
    version: str
    major: int
    reason: str  # "torch's pin", "-cu12 suffix", "NVIDIA's component table", "+cu130 tag"


def cuda_packages(facts: dict) -> list[CudaPackage]:
    """Every installed package whose CUDA major is known, and how it is known."""
    own = torch_own_pins(facts)
    torch_major = torch_cuda_major(facts)
    found = []
    for name, version in sorted((facts.get("packages") or {}).items()):
        suffix = re.search(r"-cu(\d+)$", name)
        if name.startswith("nvidia-") and suffix:
            major, reason = int(suffix.group(1)), f"-cu{suffix.group(1)} suffix"
        elif name in own and torch_major is not None and _same_release(version, own[name]):
            major, reason = torch_major, "torch's pin"
        elif (major := component_cuda_major(name, version)) is not None:
            reason = "NVIDIA's component table"
        elif (major := local_cuda_major(version)) is not None:
            reason = "local version tag"
        else:
            continue
        found.append(CudaPackage(name, version, major, reason))
    return found


def _same_release(installed: str, pinned: str) -> bool:
    have, want = version_tuple(installed), version_tuple(pinned)
    return bool(want) and have[: len(want)] == want


def _component(name: str) -> str:
    return re.sub(r"-cu\d+$", "", name)


def check_cuda_packages(facts: dict) -> Verdict:
    found = cuda_packages(facts)
    torch_major = torch_cuda_major(facts)
    majors = {p.major for p in found} | ({torch_major} if torch_major is not None else set())
    if not majors:
        return skipped("cuda.packages", "no CUDA-tagged packages installed")
    keep = torch_major if torch_major is not None else max(majors)
    strays = [p for p in found if p.major != keep]
    own = torch_own_pins(facts)
    if not strays:
        basis = (
            f"torch's own pins ({len(own)} NVIDIA wheels)"
            if own
            else "suffixes and NVIDIA's component table (torch's Requires-Dist was not read)"
        )
        return passed(
            "cuda.packages",
            f"{len(found)} CUDA package(s) all belong to CUDA {keep}, judged by {basis}",
        )
    torch_version = (facts.get("torch") or {}).get("version")
    needed_by = _required_by(facts, {p.name for p in strays})
    listing = ", ".join(
        f"{p.name}=={p.version} ({p.reason}"
        + (f"; required by {', '.join(needed_by[p.name])}" if needed_by.get(p.name) else "")
        + ")"
        for p in strays
    )
    replace = sorted({n for p in strays for n in own if _component(n) == _component(p.name)})
    remove = [p.name for p in strays if p.name not in own]
    pip = pip_install(facts)
    steps = []
    if remove:
        steps.append(f"{pip.replace(' install', ' uninstall -y')} {' '.join(remove)}")
    if replace:
        # A -cu12 and a -cu13 wheel of one library may ship the same file (nvidia/cudnn/lib/
        # libcudnn.so.9): uninstalling one deletes it for both, so torch's is put back.
        steps.append(
            f"{pip} --force-reinstall --no-deps " + " ".join(f"'{n}=={own[n]}'" for n in replace)
        )
    fix = " && ".join(steps)
    blockers = sorted({b for p in strays for b in needed_by.get(p.name, [])})
    if blockers:
        fix += f"; then install {', '.join(blockers)} built for CUDA {keep}"
    other = "/".join(sorted({str(p.major) for p in strays}))
    return failed(
        "cuda.packages",
        f"torch {torch_version} is built for CUDA {keep} but CUDA {other} package(s) are "
        f"installed next to it: {listing}",
        fix + _fix_note(torch_version, bool(own), bool(remove), bool(replace)),
    )


def _fix_note(torch_version: str | None, pins_read: bool, remove: bool, replace: bool) -> str:
    if not remove:
        return ""
    if not pins_read:
        return (
            f" (packages of another CUDA major; torch {torch_version}'s Requires-Dist was not read)"
        )
    put_back = "; torch's own wheels are reinstalled at its pins" if replace else ""
    return f" (removes only what torch {torch_version} does not depend on{put_back})"


def _required_by(facts: dict, names: set[str]) -> dict[str, list[str]]:
    """{stray: [installed packages whose Requires-Dist names it]}, where the facts say."""
    found: dict[str, list[str]] = {}
    for owner, lines in sorted((facts.get("requires") or {}).items()):
        for name in _requirement_specs(lines or [], extras=set()):
            if name in names and owner != name:
                found.setdefault(name, []).append(owner)
    return found


def check_persistence_mode(facts: dict) -> Verdict:
    gpus = (facts.get("nvidia_smi") or {}).get("gpus") or []
    modes = [g.get("persistence_mode") for g in gpus if g.get("persistence_mode")]
    if not modes:
        return skipped("gpu.persistence", "persistence mode not reported")
    off = [str(g.get("index")) for g in gpus if g.get("persistence_mode") == "Disabled"]
    if off:
        return warned(
            "gpu.persistence",
            f"persistence mode off on GPU {', '.join(off)}: slower first CUDA init, and "
            "NoNewPrivileges= units cannot create device nodes",
            "systemctl enable --now nvidia-persistenced (or nvidia-smi -pm 1)",
        )
    return passed("gpu.persistence", "persistence mode on")
