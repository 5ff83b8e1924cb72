"""Compatibility rules over host facts: pure functions, no I/O.

Each ``check_*`` takes the facts dict that :mod:`ddtree_cli.remote.facts` produces (and,
where it matters, a :class:`SnapshotABI` describing the SGLang snapshot to be served) and
returns one :class:`~ddtree_cli.verdict.Verdict` with the exact fix. ``deploy``'s
preflight and ``doctor`` both run them; :data:`ABI_CHECKS` lists them in order.

Rules that depend on something absent say so: with no NVIDIA driver only ``gpu.driver``
fails, and the GPU rules behind it skip with that reason, so the root cause stands out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ddtree_cli.verdict import Verdict, failed, passed, skipped, warned

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


@dataclass(frozen=True)
class SnapshotABI:
    """What the snapshot to be served needs from the interpreter."""

    version: str | None = None
    requires_python: str | None = None  # e.g. ">=3.11", from the snapshot's dist-info
    # (path relative to the snapshot, tag): tag is "cp311", "cp313t" or "abi3".
    compiled: list[tuple[str, str]] = field(default_factory=list)
    wheel_tags: list[str] = field(default_factory=list)  # "cp311-cp311-manylinux_2_34_x86_64"


# --- small parsers -------------------------------------------------------------------


def version_tuple(version: str | None) -> tuple[int, ...]:
    """Leading numeric release of a version string: "2.11.0+cu130" -> (2, 11, 0)."""
    if not version:
        return ()
    parts = []
    for piece in re.split(r"[.+\-]", version):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def base_version(version: str | None) -> str:
    return (version or "").split("+", 1)[0]


def local_cuda_major(version: str | None) -> int | None:
    """CUDA major from a local version tag: "+cu130" -> 13, "+cu128" -> 12, "+cpu" -> None."""
    match = re.search(r"\+cu(\d+)", version or "")
    if not match:
        return None
    digits = match.group(1)
    return int(digits[:-1]) if len(digits) >= 3 else int(digits)


def torch_cuda_major(facts: dict) -> int | None:
    torch = facts.get("torch") or {}
    cuda = version_tuple(torch.get("cuda"))
    return cuda[0] if cuda else local_cuda_major(torch.get("version"))


def capability_tuple(cap: str | None) -> tuple[int, int] | None:
    parts = version_tuple(cap)
    return (parts[0], parts[1]) if len(parts) >= 2 else None


def _sm(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def _arch_entries(arch_list: list[str]) -> list[tuple[str, tuple[int, int]]]:
    """("sm"|"compute", (major, minor)) per arch-list entry; "sm_90a" counts as sm_90."""
    entries = []
    for item in arch_list:
        match = re.match(r"^(sm|compute)_(\d+)(\d)[a-z]?$", item)
        if match:
            entries.append((match.group(1), (int(match.group(2)), int(match.group(3)))))
    return entries


def _pins(requires: list[str]) -> dict[str, str]:
    """Exact pins ("name==version") from Requires-Dist lines, skipping optional extras."""
    pins = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        if "extra ==" in marker:
            continue
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^\s,;]+)\s*$", requirement)
        if match:
            pins[_normalise(match.group(1))] = match.group(3)
    return pins


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _python_of_tag(tag: str) -> str:
    """ "cp311" -> "3.11", "cp313t" -> "3.13t"."""
    match = re.match(r"^cp(\d)(\d+)(t?)$", tag)
    return f"{match.group(1)}.{match.group(2)}{match.group(3)}" if match else tag


def _no_driver(facts: dict) -> str | None:
    smi = facts.get("nvidia_smi") or {}
    if not smi.get("present"):
        return "no NVIDIA driver (nvidia-smi not found)"
    if not smi.get("driver_version"):
        return "nvidia-smi did not report a driver: " + (smi.get("error") or "no output")
    return None


def _torch_missing(facts: dict) -> str | None:
    torch = facts.get("torch") or {}
    if torch.get("installed") is False:
        return "torch is not installed"
    if not torch.get("version"):
        return "torch could not be imported: " + (torch.get("error") or "unknown error")
    return None


def _driver_label(smi: dict) -> str:
    cuda = smi.get("cuda_version")
    return f"{smi.get('driver_version')} (CUDA {cuda})" if cuda else str(smi.get("driver_version"))


def _pip(facts: dict) -> str:
    return f"{(facts.get('python') or {}).get('executable') or 'python3'} -m pip install"


def _sglang_pins(facts: dict) -> dict[str, str]:
    return _pins((facts.get("requires") or {}).get("sglang") or [])


# --- rules ---------------------------------------------------------------------------


def check_python_version(facts: dict, snapshot: SnapshotABI | None = None) -> Verdict:
    python = facts.get("python") or {}
    if not python.get("found"):
        return failed(
            "python.version",
            f"cannot run {python.get('executable')}: {python.get('error')}",
            "pass --python with the path of the venv's python that serves SGLang",
        )
    need = ">=3.10"
    if snapshot and snapshot.requires_python:
        need = snapshot.requires_python
    lower = re.search(r">=\s*([0-9.]+)", need)
    minimum = version_tuple(lower.group(1)) if lower else ()
    have = version_tuple(python.get("version"))
    if minimum and have[: len(minimum)] < minimum:
        return failed(
            "python.version",
            f"Python {python.get('version')}; SGLang needs {need}",
            f"create the venv with python{'.'.join(map(str, minimum))} or newer",
        )
    return passed("python.version", f"Python {python.get('version')} ({python.get('abi_tag')})")


def check_python_abi(facts: dict, snapshot: SnapshotABI | None = None) -> Verdict:
    """Compiled modules in the snapshot must match the serving interpreter's ABI tag."""
    if snapshot is None:
        return skipped("python.abi", "no --snapshot given")
    python = facts.get("python") or {}
    if not python.get("found"):
        return skipped("python.abi", "the serving interpreter could not be run")
    tag = python.get("abi_tag")
    wrong = [(path, t) for path, t in snapshot.compiled if t != "abi3" and t != tag]
    wheel_py = {w.split("-")[0] for w in snapshot.wheel_tags if w.split("-")[0].startswith("cp")}
    if wrong:
        tags = sorted({t for _, t in wrong})
        example = wrong[0][0]
        return failed(
            "python.abi",
            f"{len(wrong)} compiled module(s) in the snapshot are built for {', '.join(tags)} "
            f"but the host runs {tag} (e.g. {example})",
            f"serve from a Python {_python_of_tag(tags[0])} venv, or use the sglang wheel "
            f"built for {tag}",
        )
    if wheel_py and tag not in wheel_py:
        return failed(
            "python.abi",
            f"the snapshot's wheel is tagged {', '.join(sorted(wheel_py))} but the host runs {tag}",
            f"serve from a Python {_python_of_tag(sorted(wheel_py)[0])} venv, or use the "
            f"sglang wheel built for {tag}",
        )
    count = len(snapshot.compiled)
    return passed(
        "python.abi",
        f"{count} compiled module(s) match {tag}"
        if count
        else f"no compiled modules in the snapshot; {tag} is fine",
    )


def check_torch_installed(facts: dict) -> Verdict:
    torch = facts.get("torch") or {}
    pin = _sglang_pins(facts).get("torch")
    spec = f"torch=={pin}" if pin else "torch"
    if torch.get("installed") is False:
        return failed("torch.installed", "torch is not installed", f"{_pip(facts)} '{spec}'")
    if torch.get("installed") is None or not torch.get("version"):
        return failed(
            "torch.installed",
            f"importing torch failed: {torch.get('error') or 'unknown error'}",
            f"{_pip(facts)} --force-reinstall '{spec}'",
        )
    return passed("torch.installed", f"torch {torch['version']}")


def check_torch_cuda_build(facts: dict) -> Verdict:
    missing = _torch_missing(facts)
    if missing:
        return skipped("torch.cuda_build", missing)
    torch = facts["torch"]
    if torch.get("hip"):
        return failed(
            "torch.cuda_build",
            f"torch {torch['version']} is a ROCm build; this stack needs CUDA",
            f"{_pip(facts)} 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu130",
        )
    if not torch.get("cuda"):
        return failed(
            "torch.cuda_build",
            f"torch {torch['version']} is a CPU-only build",
            f"{_pip(facts)} --force-reinstall 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu{_suggested_cuda_tag(facts)}",
        )
    return passed("torch.cuda_build", f"torch {torch['version']} built for CUDA {torch['cuda']}")


def _suggested_cuda_tag(facts: dict) -> str:
    """cu130 when the driver can run CUDA 13 (or is unknown), else cu128."""
    driver_cuda = version_tuple((facts.get("nvidia_smi") or {}).get("cuda_version"))
    return "128" if driver_cuda and driver_cuda < (13, 0) else "130"


def check_driver_present(facts: dict) -> Verdict:
    reason = _no_driver(facts)
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
        f"driver {_driver_label(smi)}, {len(gpus)} × {', '.join(names)}",
    )


def check_driver_vs_torch(facts: dict) -> Verdict:
    reason = _no_driver(facts) or _torch_missing(facts)
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
        f"driver {_driver_label(smi)} >= torch CUDA {torch['cuda']}",
    )


def check_cuda_available(facts: dict) -> Verdict:
    reason = _no_driver(facts) or _torch_missing(facts)
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
    reason = _no_driver(facts) or _torch_missing(facts)
    if reason:
        return skipped("gpu.arch", reason)
    torch = facts["torch"]
    if not torch.get("cuda"):
        return skipped("gpu.arch", f"torch {torch['version']} has no CUDA build")
    arch_list = torch.get("arch_list") or []
    if not arch_list:
        return skipped("gpu.arch", "torch did not report its arch list")
    entries = _arch_entries(arch_list)
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
            jit_only.append(f"{name} ({_sm(cap)})")
        else:
            missing.append((cap, name))
    if missing:
        cap, name = missing[0]
        need = MIN_CUDA_FOR_CAPABILITY.get(cap)
        build = f"cu{need[0]}{need[1]}" if need else "a newer CUDA"
        return failed(
            "gpu.arch",
            f"{name} is {_sm(cap)}; torch {torch['version']} supports {' '.join(arch_list)}",
            f"install a torch build with {_sm(cap)} ({build} or newer): "
            f"{_pip(facts)} --force-reinstall 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu{_suggested_cuda_tag(facts)}",
        )
    if jit_only:
        return warned(
            "gpu.arch",
            f"only PTX for {', '.join(jit_only)}: kernels JIT-compile at first use (slow start)",
            "install a torch build with SASS for that architecture",
        )
    return passed("gpu.arch", f"{', '.join(_sm(c) for c in sorted(caps))} in torch's arch list")


def check_nvcc(facts: dict) -> Verdict:
    """FlashInfer/DeepGEMM JIT with a host nvcc of another CUDA major caches broken kernels."""
    major = torch_cuda_major(facts)
    missing = _torch_missing(facts)
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
                f"nvcc {nvcc['release']} cannot build for {_sm(cap)} (needs {need[0]}.{need[1]}+)",
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
            specs[_normalise(match.group(1))] = spec
            if extra is None and match.group(3) is not None:
                specs[f"{_normalise(match.group(1))}[]"] = match.group(3)
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


def cuda_majors_of_packages(facts: dict) -> dict[int, list[str]]:
    """CUDA major -> the installed packages that are built for it."""
    majors: dict[int, list[str]] = {}
    for package in cuda_packages(facts):
        majors.setdefault(package.major, []).append(f"{package.name}=={package.version}")
    return majors


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
            f"torch's own pins ({len(own)} NVIDIA wheels)" if own else "suffixes and NVIDIA's "
            "component table (torch's Requires-Dist was not read)"
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
    pip = _pip(facts)
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
        return f" (packages of another CUDA major; torch {torch_version}'s Requires-Dist was not read)"
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


_PROBE_PACKAGE = {
    "sgl_kernel": "sglang-kernel",
    "flashinfer": "flashinfer-python",
    "sglang": "sglang",
}


def check_probe(facts: dict, module: str) -> Verdict:
    check_id = f"kernels.{module}"
    probe = (facts.get("probes") or {}).get(module)
    if probe is None:
        return skipped(check_id, "import probes were not run")
    if probe.get("status") == "missing":
        if module == "sglang":
            return warned(
                check_id,
                "sglang is not installed in the serving venv",
                f"{_pip(facts)} 'sglang==VERSION' (your snapshot's version; --snapshot checks it)",
            )
        return skipped(check_id, f"{module} is not installed")
    if probe.get("status") == "ok":
        return passed(check_id, f"import {module} works")
    error = probe.get("error") or ""
    kind = probe.get("error_kind")
    pins = _sglang_pins(facts)
    packages = facts.get("packages") or {}
    dist = _PROBE_PACKAGE.get(module, module)
    if module == "sgl_kernel" and "sgl-kernel" in packages and "sglang-kernel" not in packages:
        dist = "sgl-kernel"
    torch_version = (facts.get("torch") or {}).get("version")
    if kind == "undefined_symbol":
        symbol = re.search(r"undefined symbol: (\S+)", error)
        # Reinstall only what differs from sglang's pins (the kernel, as a rule): reinstalling
        # a torch that already matches would fetch gigabytes and fix nothing. --no-deps keeps
        # pip from pulling another torch in with the kernel.
        pinned = [n for n in ("torch", dist) if n in pins]
        wrong = [n for n in pinned if base_version(packages.get(n)) != base_version(pins[n])]
        chosen = wrong or [n for n in pinned if n == dist]
        fix = (
            f"{_pip(facts)} --force-reinstall --no-deps "
            + " ".join(f"'{n}=={pins[n]}'" for n in chosen)
            + f"  (what sglang {packages.get('sglang', '')} pins)"
            if chosen
            else f"reinstall {dist} built for torch {torch_version}"
        )
        return failed(
            check_id,
            f"{dist} {packages.get(dist, '')} was built for another torch than "
            f"{torch_version}: undefined symbol {symbol.group(1) if symbol else ''}".strip(),
            fix,
        )
    if kind in ("common_ops", "missing_library"):
        return failed(
            check_id,
            f"import {module} cannot load its CUDA libraries: {error.splitlines()[-1]}",
            f"make every CUDA package match torch's CUDA {torch_cuda_major(facts)} "
            f"(see cuda.packages); reinstall {dist} for that CUDA",
        )
    if kind == "flashinfer_version":
        return failed(
            check_id,
            error.splitlines()[-1],
            "align flashinfer-python, "
            "flashinfer-cubin and flashinfer-jit-cache (see flashinfer.versions)",
        )
    if kind == "timeout":
        return warned(check_id, f"import {module} did not finish in time", "")
    pinned = pins.get(dist)
    spec = f"'{dist}=={pinned}'" if pinned else f"'{dist}'"
    last = error.splitlines()[-1] if error else kind
    return failed(
        check_id, f"import {module} failed: {last}", f"{_pip(facts)} --force-reinstall {spec}"
    )


def check_flashinfer_versions(facts: dict) -> Verdict:
    packages = facts.get("packages") or {}
    parts = {
        n: packages[n]
        for n in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")
        if n in packages
    }
    if not parts:
        return skipped("flashinfer.versions", "flashinfer is not installed")
    bases = {base_version(v) for v in parts.values()}
    listing = ", ".join(f"{n} {v}" for n, v in parts.items())
    if len(bases) > 1:
        target = parts.get("flashinfer-python") or max(parts.values(), key=version_tuple)
        target = base_version(target)
        strays = [n for n, v in parts.items() if base_version(v) != target]
        return failed(
            "flashinfer.versions",
            f"versions differ: {listing}",
            f"{_pip(facts)} "
            + " ".join(f"'{n}=={target}'" for n in strays)
            + " (cubin and jit-cache come from the FlashInfer wheel index for your CUDA)",
        )
    return passed("flashinfer.versions", listing)


def check_jit_cache(facts: dict) -> Verdict:
    """Kernels FlashInfer JIT-compiled earlier must link the libcudart of torch's CUDA major:
    a cache built by another nvcc is reused silently and fails at launch."""
    cache = facts.get("jit_cache") or {}
    if not cache.get("dirs"):
        return skipped("flashinfer.jit_cache", "no FlashInfer JIT cache on this host")
    major = torch_cuda_major(facts)
    if major is None:
        return skipped("flashinfer.jit_cache", "torch has no CUDA build to compare with")
    linked = cache.get("cudart") or {}
    wrong = {lib: e for lib, e in linked.items() if lib != f"libcudart.so.{major}"}
    dirs = " ".join(cache["dirs"])
    if wrong:
        lib, entry = sorted(wrong.items())[0]
        return failed(
            "flashinfer.jit_cache",
            f"{entry['count']} cached kernel(s) link {lib} but torch uses CUDA {major} "
            f"(e.g. {entry['example']})",
            f"rm -rf {dirs}  (FlashInfer rebuilds what it needs at the next start)",
        )
    return passed(
        "flashinfer.jit_cache",
        f"{cache.get('files', 0)} cached kernel(s) in {dirs}, none built for another CUDA",
    )


def check_flashinfer_version_check_env(facts: dict) -> Verdict:
    value = (facts.get("env") or {}).get("FLASHINFER_DISABLE_VERSION_CHECK")
    if value in (None, "", "0"):
        return passed("flashinfer.version_check", "FLASHINFER_DISABLE_VERSION_CHECK is not set")
    return warned(
        "flashinfer.version_check",
        f"FLASHINFER_DISABLE_VERSION_CHECK={value} hides flashinfer/cubin mismatches, which "
        "then surface as illegal memory accesses",
        "unset FLASHINFER_DISABLE_VERSION_CHECK (shell profile or the unit's Environment=) "
        "and align the flashinfer packages instead",
    )


# The pins whose mismatch breaks at import or at kernel launch (compiled against torch's ABI).
_ABI_PINNED = ("torch", "sglang-kernel", "sgl-kernel", "flashinfer-python", "flashinfer-cubin")


def check_sglang_pins(facts: dict) -> Verdict:
    """Installed torch/kernels must equal what sglang pins: the kernel wheels declare no torch
    requirement of their own, so pip happily pairs them with another torch."""
    packages = facts.get("packages") or {}
    if "sglang" not in packages:
        return skipped("sglang.pins", "sglang is not installed in the serving venv")
    pins = _sglang_pins(facts)
    wanted = {n: v for n, v in pins.items() if n in _ABI_PINNED}
    if not wanted:
        if not (facts.get("requires") or {}).get("sglang"):
            return skipped("sglang.pins", "sglang's requirements (Requires-Dist) were not read")
        return skipped("sglang.pins", f"sglang {packages['sglang']} pins none of torch/kernels")
    wrong = [
        (n, v, packages[n])
        for n, v in sorted(wanted.items())
        if n in packages and base_version(packages[n]) != base_version(v)
    ]
    absent = [(n, v) for n, v in sorted(wanted.items()) if n not in packages]
    if wrong:
        detail = ", ".join(f"{n} {h} (pinned {v})" for n, v, h in wrong)
        return failed(
            "sglang.pins",
            f"sglang {packages['sglang']} pins other versions: {detail}",
            f"{_pip(facts)} " + " ".join(f"'{n}=={v}'" for n, v, _ in wrong),
        )
    if absent:
        return warned(
            "sglang.pins",
            f"sglang {packages['sglang']} pins {', '.join(f'{n}=={v}' for n, v in absent)}, "
            "not installed",
            f"{_pip(facts)} " + " ".join(f"'{n}=={v}'" for n, v in absent),
        )
    return passed(
        "sglang.pins",
        f"installed versions match sglang {packages['sglang']}'s pins "
        f"({', '.join(f'{n}=={v}' for n, v in sorted(wanted.items()))})",
    )


def check_sglang_vs_snapshot(facts: dict, snapshot: SnapshotABI | None = None) -> Verdict:
    if snapshot is None or not snapshot.version:
        return skipped("sglang.version", "no --snapshot given")
    installed = (facts.get("packages") or {}).get("sglang")
    if installed is None:
        return failed(
            "sglang.version",
            f"sglang is not installed; the snapshot is {snapshot.version}",
            f"{_pip(facts)} 'sglang=={snapshot.version}' (installs the kernels it pins)",
        )
    if base_version(installed) != base_version(snapshot.version):
        return failed(
            "sglang.version",
            f"installed sglang {installed} but the snapshot is {snapshot.version}: its "
            "pinned torch/kernels belong to another release",
            f"{_pip(facts)} 'sglang=={snapshot.version}'",
        )
    return passed("sglang.version", f"installed sglang {installed} = snapshot {snapshot.version}")


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
