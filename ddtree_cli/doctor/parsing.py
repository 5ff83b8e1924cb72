"""Small readings the rules share: version strings, wheel and SM tags, pins, and the
facts about the serving interpreter and driver that several rules name in their fixes."""

from __future__ import annotations

import re


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


def sm_label(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def arch_entries(arch_list: list[str]) -> list[tuple[str, tuple[int, int]]]:
    """("sm"|"compute", (major, minor)) per arch-list entry; "sm_90a" counts as sm_90."""
    entries = []
    for item in arch_list:
        match = re.match(r"^(sm|compute)_(\d+)(\d)[a-z]?$", item)
        if match:
            entries.append((match.group(1), (int(match.group(2)), int(match.group(3)))))
    return entries


def exact_pins(requires: list[str]) -> dict[str, str]:
    """Exact pins ("name==version") from Requires-Dist lines, skipping optional extras."""
    pins = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        if "extra ==" in marker:
            continue
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^\s,;]+)\s*$", requirement)
        if match:
            pins[normalise_name(match.group(1))] = match.group(3)
    return pins


def normalise_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python_of_tag(tag: str) -> str:
    """ "cp311" -> "3.11", "cp313t" -> "3.13t"."""
    match = re.match(r"^cp(\d)(\d+)(t?)$", tag)
    return f"{match.group(1)}.{match.group(2)}{match.group(3)}" if match else tag


def no_driver_reason(facts: dict) -> str | None:
    smi = facts.get("nvidia_smi") or {}
    if not smi.get("present"):
        return "no NVIDIA driver (nvidia-smi not found)"
    if not smi.get("driver_version"):
        return "nvidia-smi did not report a driver: " + (smi.get("error") or "no output")
    return None


def torch_missing_reason(facts: dict) -> str | None:
    torch = facts.get("torch") or {}
    if torch.get("installed") is False:
        return "torch is not installed"
    if not torch.get("version"):
        return "torch could not be imported: " + (torch.get("error") or "unknown error")
    return None


def driver_label(smi: dict) -> str:
    cuda = smi.get("cuda_version")
    return f"{smi.get('driver_version')} (CUDA {cuda})" if cuda else str(smi.get("driver_version"))


def pip_install(facts: dict) -> str:
    return f"{(facts.get('python') or {}).get('executable') or 'python3'} -m pip install"


def sglang_pins(facts: dict) -> dict[str, str]:
    return exact_pins((facts.get("requires") or {}).get("sglang") or [])
