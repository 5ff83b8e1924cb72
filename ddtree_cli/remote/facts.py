"""Host facts: everything `doctor` and `deploy`'s preflight judge, gathered as one JSON object.

This file is deliberately one self-contained script: standard library only, valid on any
python3 >= 3.8, and tolerant of a host with no torch, no nvidia-smi, no nvcc, no systemd.
It runs three ways with identical results:

- imported: :func:`collect_local` gathers facts about this machine in-process;
- piped over SSH: :func:`collect_remote` sends this file's source to ``python3 -`` on the
  host and parses the JSON it prints (so nothing is installed on the host);
- by hand: ``python3 facts.py --python /opt/venv/bin/python --unit sglang --port 30000``.

Facts about the *serving* interpreter (Python ABI, packages, torch, kernel imports) come
from subprocesses of ``--python`` (the venv SGLang runs in), each with a timeout, so a
segfaulting or hanging import is recorded instead of taking the collector down.

Schema (``FACTS_SCHEMA`` = 1; every section is always present, absent things are
``present: false`` / ``installed: false`` / ``null`` with an ``error`` string saying why):

``hostname``, ``collected_at`` (UTC ISO), ``platform`` {system, machine, kernel},
``python`` {executable, found, version, implementation, abi_tag ("cp312"), soabi,
ext_suffix, gil_disabled, error},
``packages`` {normalised-name: version} (nvidia-*, flashinfer*, sgl-kernel, sglang*,
torch*, triton, cuda-toolkit, ...), ``requires`` {name: [Requires-Dist lines]} for each of
those packages (torch's and cuda-toolkit's name the exact NVIDIA wheels torch was built with),
``torch`` {installed, version ("2.11.0+cu130"), cuda ("13.0"), hip, cuda_available,
arch_list (["sm_90", ...]), device_count, devices [{name, capability}], warnings, error},
``nvidia_smi`` {present, driver_version, cuda_version (driver's CUDA, "13.0"), gpus
[{index, name, uuid, compute_cap, memory_used_mib, memory_total_mib,
persistence_mode}], compute_apps
[{pid, process_name, gpu_uuid, used_memory_mib}], error},
``nvcc`` {present, path, release ("13.0"), error}, ``jit_cache`` {dirs, files, cudart
{"libcudart.so.12": {count, example}}, errors} (FlashInfer's JIT cache under ~/.cache), ``env`` {whitelisted variables,
from the process and from the unit's Environment=}, ``disk`` [{path, free_bytes,
total_bytes}], ``systemd`` {present, unit, properties {LoadState, ActiveState, SubState,
Result, ExecMainStatus, ExecMainPID, NRestarts, LimitNOFILE, KillMode, PrivateDevices, ...},
server_args {whitelisted flags of ExecStart}, journal [last lines], error},
``checkpoints`` {role ("target" | "draft"): {path, local, config {model_type,
architectures, num_hidden_layers, dflash_config {block_size, target_layer_ids,
num_target_layers, mask_token_id}}, error}} (from ``--checkpoint`` or the unit's
``--model-path`` / ``--speculative-draft-model-path``; only config.json is read),
``ports`` [{port, listening, pids, processes, cgroups}], ``processes`` [{pid, name, cmdline,
cgroup, ppid, parent_cmdline, parent_is_launcher, parent_is_sglang, unit, unit_active_state}]
(``sglang::`` processes, live or left over), ``probes`` {module: {status "ok" | "missing" |
"error" | "timeout", error, error_kind}}, ``health`` {url, status, body, error} or null.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import socket
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

FACTS_SCHEMA = 1

# Variables that change how the stack behaves; anything else (tokens!) is never collected.
ENV_KEYS = (
    "FLASHINFER_DISABLE_VERSION_CHECK",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "LD_LIBRARY_PATH",
    "TRITON_PTXAS_PATH",
    "FLASHINFER_WORKSPACE_BASE",
    "FLASHINFER_JIT_DIR",
    "TORCH_CUDA_ARCH_LIST",
)

PACKAGE_PATTERN = (
    r"^(nvidia-.*|flashinfer.*|sgl-kernel|sglang.*|torch|torchvision|torchaudio|triton|"
    r"pytorch-triton|transformers|xgrammar|cuda-python|cuda-bindings|cuda-toolkit|"
    r"apache-tvm-ffi)$"
)

PROBE_MODULES = ("sgl_kernel", "flashinfer", "sglang")

SYSTEMD_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "ExecMainStatus",
    "ExecMainCode",
    "ExecMainPID",
    "NRestarts",
    "FragmentPath",
    "ControlGroup",
    "LimitNOFILE",
    "KillMode",
    "PrivateDevices",
    "DevicePolicy",
)

# Server flags read from the unit's ExecStart; other arguments (keys, paths) are not kept.
SERVER_FLAGS = (
    "--attention-backend",
    "--prefill-attention-backend",
    "--decode-attention-backend",
    "--speculative-algorithm",
    "--speculative-draft-attention-backend",
)

# Run by the serving interpreter (any python3 >= 3.8): its version, ABI and packages.
_INTERPRETER_SNIPPET = r"""
import json, platform, re, sys, sysconfig
out = {"executable": sys.executable, "version": platform.python_version(),
       "implementation": sys.implementation.name,
       "soabi": sysconfig.get_config_var("SOABI"),
       "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
       "gil_disabled": bool(sysconfig.get_config_var("Py_GIL_DISABLED"))}
prefix = {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, sys.implementation.name)
out["abi_tag"] = "%s%d%d%s" % (prefix, sys.version_info[0], sys.version_info[1],
                               "t" if out["gil_disabled"] else "")
pkgs, requires, err = {}, {}, None
try:
    from importlib import metadata
    pattern = re.compile(sys.argv[1])
    for dist in metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower()
        # distributions() walks sys.path in order: the first one found is the one imported
        # (a --target dir on PYTHONPATH shadows site-packages); later copies are shadowed.
        if name and pattern.match(name) and name not in pkgs:
            pkgs[name] = dist.version
            requires[name] = list(dist.requires or [])
except Exception as exc:
    err = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps({"python": out, "packages": pkgs, "requires": requires, "error": err}))
"""

# Run by the serving interpreter: what torch was built for and what it can see.
_TORCH_SNIPPET = r"""
import json, warnings
out = {"installed": False}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        import torch
    except ModuleNotFoundError:
        print(json.dumps(out)); raise SystemExit(0)
    out["installed"] = True
    out["version"] = torch.__version__
    out["cuda"] = getattr(torch.version, "cuda", None)
    out["hip"] = getattr(torch.version, "hip", None)
    try:
        # Arch flags are compiled in; get_arch_list() returns [] when CUDA is unavailable.
        flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, "_cuda_getArchFlags") else ""
        out["arch_list"] = (flags or "").split()
    except Exception:
        out["arch_list"] = []
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
    if out["cuda_available"]:
        if not out["arch_list"]:
            out["arch_list"] = list(torch.cuda.get_arch_list())
        out["devices"] = [
            {"name": torch.cuda.get_device_name(i),
             "capability": "%d.%d" % torch.cuda.get_device_capability(i)}
            for i in range(out["device_count"])]
    else:
        out["devices"] = []
out["warnings"] = [str(w.message) for w in caught]
print(json.dumps(out))
"""

# Run by the serving interpreter, once per module: does the compiled extension load?
_PROBE_SNIPPET = r"""
import importlib, importlib.util, json, sys
name = sys.argv[1]
try:
    found = importlib.util.find_spec(name) is not None
except Exception:
    found = False
if not found:
    print(json.dumps({"status": "missing"})); raise SystemExit(0)
importlib.import_module(name)
print(json.dumps({"status": "ok"}))
"""

_PROBE_ERROR_KINDS = (
    ("undefined symbol", "undefined_symbol"),
    ("Could not load any common_ops library", "common_ops"),
    ("cannot open shared object file", "missing_library"),
    ("does not match flashinfer version", "flashinfer_version"),
    ("no kernel image is available", "no_kernel_image"),
    ("driver on your system is too old", "driver_too_old"),
)


def classify_import_error(text: str) -> str:
    """Name the failure behind an import's stderr ("undefined_symbol", ...)."""
    for needle, label in _PROBE_ERROR_KINDS:
        if needle in (text or ""):
            return label
    return "import_error"


def _run(argv: list[str], timeout: float, stdin: str | None = None) -> tuple[int, str, str]:
    """Run a command; (127, "", reason) when it is absent, (124, out, reason) on timeout."""
    try:
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except PermissionError as exc:
        return 126, "", f"{argv[0]}: {exc}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        return 124, out, f"{argv[0]}: timed out after {timeout}s"
    return proc.returncode, proc.stdout, proc.stderr


def _last_lines(text: str, count: int = 3) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return "\n".join(lines[-count:])


def _json_from(stdout: str) -> dict | None:
    for line in reversed((stdout or "").strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def interpreter_facts(python: str, timeout: float) -> dict:
    """Python version/ABI, filtered package versions and sglang's pins, from ``python``."""
    rc, out, err = _run([python, "-c", _INTERPRETER_SNIPPET, PACKAGE_PATTERN], timeout)
    parsed = _json_from(out) if rc == 0 else None
    if parsed is None:
        reason = _last_lines(err) or f"exit status {rc}"
        return {
            "python": {"executable": python, "found": False, "error": reason},
            "packages": {},
            "requires": {},
        }
    info = parsed["python"]
    info.update(found=True, error=parsed.get("error"))
    return {"python": info, "packages": parsed["packages"], "requires": parsed["requires"]}


def torch_facts(python: str, timeout: float) -> dict:
    rc, out, err = _run([python, "-c", _TORCH_SNIPPET], timeout)
    parsed = _json_from(out)
    if rc == 0 and parsed is not None:
        parsed.setdefault("error", None)
        if err.strip():
            parsed["stderr"] = _last_lines(err, 5)
        return parsed
    return {"installed": None, "error": _last_lines(err) or f"exit status {rc}"}


def probe_one(python: str, timeout: float, name: str) -> dict:
    """Import ``name`` in a fresh ``python``: ok / missing / error (classified) / timeout."""
    rc, out, err = _run([python, "-c", _PROBE_SNIPPET, name], timeout)
    parsed = _json_from(out) if rc == 0 else None
    if parsed is not None:
        parsed.update(error=None, error_kind=None)
        return parsed
    kind = "timeout" if rc == 124 else "crash" if rc < 0 else classify_import_error(err)
    error = _last_lines(err, 2) or f"exit status {rc}"
    # sgl_kernel's loader lists every attempt and ends with "No module named 'common_ops'":
    # keep the line that names the missing symbol, which says which torch it wants.
    symbol = [line.strip() for line in err.splitlines() if "undefined symbol" in line]
    if kind == "undefined_symbol" and symbol and symbol[0] not in error:
        error = symbol[0] + "\n" + error
    return {"status": "timeout" if rc == 124 else "error", "error": error, "error_kind": kind}


def probe_facts(python: str, timeout: float, modules=PROBE_MODULES) -> dict:
    return {name: probe_one(python, timeout, name) for name in modules}


def _csv_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip()
    ]


def _int_or_none(text: str) -> int | None:
    try:
        return int(float(text))
    except (TypeError, ValueError):
        return None


def parse_smi_header(text: str) -> tuple[str | None, str | None]:
    """(driver version, the driver's CUDA version) from plain ``nvidia-smi`` output."""
    driver = re.search(r"Driver Version:\s*([0-9.]+)", text or "")
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", text or "")
    return (driver.group(1) if driver else None, cuda.group(1) if cuda else None)


def parse_gpu_rows(text: str, fields: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits``."""
    gpus = []
    names = fields.split(",")
    for row in _csv_rows(text):
        gpu = dict(zip(names, row))  # noqa: B905 - strict= needs 3.10; this runs on 3.8
        gpus.append(
            {
                "index": _int_or_none(gpu.get("index", "")),
                "name": gpu.get("name"),
                "uuid": gpu.get("uuid"),
                "compute_cap": gpu.get("compute_cap"),
                "memory_used_mib": _int_or_none(gpu.get("memory.used", "")),
                "memory_total_mib": _int_or_none(gpu.get("memory.total", "")),
                "driver_version": gpu.get("driver_version"),
                "persistence_mode": gpu.get("persistence_mode"),
            }
        )
    return gpus


def parse_nvcc_release(text: str) -> str | None:
    """ "13.0" from ``nvcc --version`` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    match = re.search(r"release\s+([0-9]+\.[0-9]+)", text or "")
    return match.group(1) if match else None


def nvidia_smi_facts(timeout: float) -> dict:
    facts: dict = {"present": False, "driver_version": None, "cuda_version": None, "gpus": []}
    facts["compute_apps"] = []
    exe = shutil.which("nvidia-smi")
    if exe is None:
        facts["error"] = "nvidia-smi not found on PATH"
        return facts
    facts["present"] = True
    rc, out, err = _run([exe], timeout)
    if rc != 0:
        facts["error"] = _last_lines(out + "\n" + err, 2) or f"nvidia-smi exit status {rc}"
        return facts
    facts["driver_version"], facts["cuda_version"] = parse_smi_header(out)
    fields = "index,name,uuid,driver_version,compute_cap,memory.used,memory.total,persistence_mode"
    rc, out, err = _run([exe, "--query-gpu=" + fields, "--format=csv,noheader,nounits"], timeout)
    if rc != 0:  # drivers older than ~510 do not know compute_cap
        fields = "index,name,uuid,driver_version,memory.used,memory.total"
        rc, out, err = _run(
            [exe, "--query-gpu=" + fields, "--format=csv,noheader,nounits"], timeout
        )
    facts["gpus"] = parse_gpu_rows(out, fields) if rc == 0 else []
    if not facts["driver_version"] and facts["gpus"]:
        facts["driver_version"] = facts["gpus"][0].pop("driver_version", None)
    for gpu in facts["gpus"]:
        gpu.pop("driver_version", None)
    if rc != 0:
        facts["error"] = _last_lines(err, 2)
    rc, out, _ = _run(
        [
            exe,
            "--query-compute-apps=pid,process_name,gpu_uuid,used_memory",
            "--format=csv,noheader,nounits",
        ],
        timeout,
    )
    for row in _csv_rows(out) if rc == 0 else []:
        if len(row) >= 4:
            facts["compute_apps"].append(
                {
                    "pid": _int_or_none(row[0]),
                    "process_name": row[1],
                    "gpu_uuid": row[2],
                    "used_memory_mib": _int_or_none(row[3]),
                }
            )
    facts.setdefault("error", None)
    return facts


def nvcc_facts(timeout: float, env: dict) -> dict:
    candidates = []
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(key):
            candidates.append(os.path.join(env[key], "bin", "nvcc"))
    candidates.append(shutil.which("nvcc") or "")
    candidates.append("/usr/local/cuda/bin/nvcc")
    exe = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if exe is None:
        return {"present": False, "path": None, "release": None, "error": "nvcc not found"}
    rc, out, err = _run([exe, "--version"], timeout)
    release = parse_nvcc_release(out)
    return {
        "present": True,
        "path": exe,
        "release": release,
        "error": None if release else (_last_lines(err) or "unrecognised nvcc --version output"),
    }


def _parse_environment_property(value: str) -> dict:
    """Pick whitelisted names out of systemd's ``Environment=A=1 B=2`` (values may hold secrets)."""
    found = {}
    for item in re.findall(r'"[^"]*"|\S+', value or ""):
        item = item.strip('"')
        key, sep, val = item.partition("=")
        if sep and key in ENV_KEYS:
            found[key] = val
    return found


_SECRET_PATTERNS = (
    # --api-key VALUE / --admin-api-key=VALUE on a logged command line
    (re.compile(r"(--[\w-]*(?:key|token|secret|password))(\s+|=)(\S+)", re.I), r"\1\2***"),
    # api_key='...', HF_TOKEN=..., "password": "..." in logged settings
    (
        re.compile(
            r"(\b[\w-]*(?:api_key|apikey|token|secret|password)['\"]?\s*[=:]\s*['\"]?)"
            r"([^'\",\s)]+)",
            re.I,
        ),
        r"\1***",
    ),
    (re.compile(r"\bhf_[A-Za-z0-9]{8,}"), "hf_***"),
)


def redact(line: str) -> str:
    """Mask credentials a server may log (SGLang logs its full server args at start)."""
    for pattern, replacement in _SECRET_PATTERNS:
        line = pattern.sub(replacement, line)
    return line


def _exec_start_flags(exec_start: str, flags) -> dict:
    """``--flag value`` / ``--flag=value`` pairs of ``flags`` from systemd's
    ``ExecStart={ ... argv[]=... ; }``."""
    match = re.search(r"argv\[\]=(.*?)(?: ;|$)", exec_start or "")
    words = (match.group(1) if match else "").split()
    found = {}
    for i, word in enumerate(words):
        flag, sep, value = word.partition("=")
        if flag in flags:
            found[flag] = value if sep else (words[i + 1] if i + 1 < len(words) else "")
    return found


def parse_server_args(exec_start: str) -> dict:
    """Whitelisted ``--flag value`` pairs from systemd's ``ExecStart={ ... argv[]=... ; }``."""
    return _exec_start_flags(exec_start, SERVER_FLAGS)


# Checkpoint folders named in ExecStart, by role; only their config.json is ever read.
CHECKPOINT_FLAGS = {"--model-path": "target", "--speculative-draft-model-path": "draft"}
_CONFIG_KEYS = ("model_type", "architectures", "num_hidden_layers")
_DFLASH_KEYS = ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id")


def checkpoint_paths(exec_start: str) -> dict:
    """``{role: path}`` of the target and draft checkpoints in an ExecStart."""
    found = _exec_start_flags(exec_start, CHECKPOINT_FLAGS)
    return {CHECKPOINT_FLAGS[flag]: path for flag, path in found.items()}


def checkpoint_facts(paths: dict) -> dict:
    """The parts of each checkpoint's config.json that decide whether SGLang can serve it."""
    out = {}
    for role, path in sorted(paths.items()):
        entry = {"path": path, "local": False, "config": None, "error": None}
        folder = os.path.expanduser(path)
        if not os.path.isdir(folder):
            entry["error"] = "not a local folder (a hub model id is not checked)"
        else:
            entry["local"] = True
            try:
                with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
                    config = json.load(handle)
                if not isinstance(config, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as exc:
                entry["error"] = "config.json: " + str(exc)
            else:
                kept = {k: config.get(k) for k in _CONFIG_KEYS}
                dflash = config.get("dflash_config")
                if isinstance(dflash, dict):
                    kept["dflash_config"] = {k: dflash.get(k) for k in _DFLASH_KEYS}
                entry["config"] = kept
        out[role] = entry
    return out


def systemd_facts(unit: str | None, timeout: float, journal_lines: int = 20) -> dict:
    facts: dict = {"present": os.path.isdir("/run/systemd/system"), "unit": unit}
    facts.update(properties={}, journal=[], environment={}, server_args={}, error=None)
    facts["checkpoint_paths"] = {}
    if not facts["present"]:
        facts["error"] = "systemd is not running (no /run/systemd/system)"
        return facts
    if not unit:
        return facts
    props = ",".join(SYSTEMD_PROPERTIES + ("Environment", "ExecStart"))
    rc, out, err = _run(["systemctl", "show", unit, "--property=" + props], timeout)
    if rc != 0:
        facts["error"] = _last_lines(err) or f"systemctl show exit status {rc}"
        return facts
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "Environment":
            facts["environment"] = _parse_environment_property(value)
        elif key == "ExecStart":
            facts["server_args"] = parse_server_args(value)
            facts["checkpoint_paths"] = checkpoint_paths(value)
        else:
            facts["properties"][key] = value
    if facts["properties"].get("LoadState") not in (None, "not-found"):
        rc, out, err = _run(
            ["journalctl", "-u", unit, "-n", str(journal_lines), "--no-pager", "-o", "cat"],
            timeout,
        )
        if rc == 0:
            facts["journal"] = [redact(line) for line in out.splitlines() if line.strip()]
        else:
            facts["error"] = "journalctl: " + (_last_lines(err) or f"exit status {rc}")
    return facts


def _listening_inodes(port: int) -> list[str]:
    inodes = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            # cols[1] is local "ADDR:PORT" in hex; state 0A is LISTEN.
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.append(cols[9])
    return inodes


def _read(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    try:
        return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    raw = _read(f"/proc/{pid}/cmdline")
    return raw.replace("\0", " ").strip() or _read(f"/proc/{pid}/comm").strip()


def _cgroup(pid: int) -> str | None:
    lines = _read(f"/proc/{pid}/cgroup").strip().splitlines()
    return lines[-1] if lines else None


def port_facts(ports: list[int]) -> list[dict]:
    result = []
    wanted = {port: set(_listening_inodes(port)) for port in ports}
    owners: dict = {port: [] for port in ports}
    if any(wanted.values()):
        for pid in _pids():
            fd_dir = f"/proc/{pid}/fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            targets = set()
            for fd in fds:
                try:
                    targets.add(os.readlink(os.path.join(fd_dir, fd)))
                except OSError:
                    continue
            for port, inodes in wanted.items():
                if any(f"socket:[{inode}]" in targets for inode in inodes):
                    owners[port].append(pid)
    for port in ports:
        pids = owners[port]
        result.append(
            {
                "port": port,
                "listening": bool(wanted[port]),
                "pids": pids,
                "processes": [redact(_cmdline(pid)) for pid in pids],
                "cgroups": [_cgroup(pid) for pid in pids],
            }
        )
    return result


# Command lines that start an SGLang server and own its sglang:: children (SGLang 0.5.13:
# ``python -m sglang.launch_server``, the ``sglang serve`` console script, the router's
# launcher); schedulers, the detokenizer and the DP controller are retitled sglang::... by
# setproctitle, which rewrites both /proc/PID/cmdline and /proc/PID/comm.
LAUNCHER_PATTERN = (
    r"(-m\s+sglang(_router)?\.launch_server\b|(^|[\s/])sglang\s+serve\b|"
    r"sglang(_router)?/launch_server\.py\b)"
)


def _ppid(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()  # the name in (...) may hold spaces
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def _is_sglang_title(pid: int) -> bool:
    return _read(f"/proc/{pid}/comm").startswith("sglang::") or _cmdline(pid).startswith("sglang::")


def unit_of_cgroup(cgroup: str | None) -> str | None:
    """The systemd unit a cgroup line belongs to ("0::/system.slice/sglang.service" ->
    "sglang.service", a login session -> "session-3.scope"); None outside any unit."""
    path = (cgroup or "").rpartition(":")[2]
    units = [part for part in path.split("/") if part.endswith((".service", ".scope"))]
    return units[-1] if units else None


def _unit_states(units: set, timeout: float) -> dict:
    if not units or not os.path.isdir("/run/systemd/system"):
        return {}
    states = {}
    for unit in sorted(units):
        rc, out, _ = _run(["systemctl", "show", unit, "--property=ActiveState", "--value"],
                          timeout)  # fmt: skip
        states[unit] = out.strip() if rc == 0 else None
    return states


def process_facts(timeout: float = 20.0) -> list[dict]:
    """``sglang::scheduler_*`` and friends (setproctitle names), wherever they run, each with
    its parent (the launcher, while it lives) and the unit whose cgroup holds it."""
    found = []
    for pid in _pids():
        comm = _read(f"/proc/{pid}/comm").strip()
        cmdline = _cmdline(pid)
        if comm.startswith("sglang::") or cmdline.startswith("sglang::"):
            # comm is cut at 15 characters ("sglang::schedul"); the retitled argv is whole.
            name = cmdline.split(" ")[0] if cmdline.startswith("sglang::") else comm
            ppid = _ppid(pid)
            parent = _cmdline(ppid) if ppid else ""
            cgroup = _cgroup(pid)
            found.append({
                "pid": pid, "name": name, "cmdline": cmdline, "cgroup": cgroup,
                "ppid": ppid, "parent_cmdline": redact(parent)[:300],
                "parent_is_launcher": bool(re.search(LAUNCHER_PATTERN, parent)),
                "parent_is_sglang": bool(ppid) and _is_sglang_title(ppid),
                "unit": unit_of_cgroup(cgroup),
            })  # fmt: skip
    states = _unit_states({p["unit"] for p in found if p["unit"]}, timeout)
    for process in found:
        process["unit_active_state"] = states.get(process["unit"])
    return found


def elf_needed(path: str) -> list[str]:
    """DT_NEEDED entries of an ELF shared object (what ``readelf -d`` lists as NEEDED)."""
    with open(path, "rb") as handle:
        data = handle.read()
    if data[:4] != b"\x7fELF":
        return []
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    if wide:
        (shoff,) = struct.unpack_from(order + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(order + "HH", data, 0x3A)
        section, dyn = order + "IIQQQQIIQQ", order + "qQ"
    else:
        (shoff,) = struct.unpack_from(order + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(order + "HH", data, 0x2E)
        section, dyn = order + "IIIIIIIIII", order + "iI"
    sections = [struct.unpack_from(section, data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for start in range(offset, offset + size, entsize or struct.calcsize(dyn)):
            tag, value = struct.unpack_from(dyn, data, start)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                needed.append(data[strtab + value : end].decode(errors="replace"))
    return needed


def jit_cache_facts(env: dict, limit: int = 2000) -> dict:
    """Which libcudart the FlashInfer JIT cache's kernels were built against."""
    bases = [os.path.expanduser("~")]
    if env.get("FLASHINFER_WORKSPACE_BASE"):
        bases.insert(0, env["FLASHINFER_WORKSPACE_BASE"])
    caches = [os.path.join(base, ".cache", "flashinfer") for base in bases]
    found = [c for c in caches if os.path.isdir(c)]
    facts: dict = {"dirs": found, "files": 0, "cudart": {}, "errors": 0}
    for cache in found:
        for folder, _, names in os.walk(cache):
            for name in names:
                if not name.endswith(".so") or facts["files"] >= limit:
                    continue
                path = os.path.join(folder, name)
                facts["files"] += 1
                try:
                    libs = elf_needed(path)
                except (OSError, ValueError, IndexError, struct.error):
                    facts["errors"] += 1
                    continue
                for lib in libs:
                    if lib.startswith("libcudart.so."):
                        entry = facts["cudart"].setdefault(lib, {"count": 0, "example": path})
                        entry["count"] += 1
    return facts


def disk_facts(paths: list[str]) -> list[dict]:
    facts, seen = [], set()
    for path in paths:
        probe = path
        while probe and not os.path.exists(probe):  # a target dir may not exist yet
            parent = os.path.dirname(probe)
            probe = parent if parent != probe else ""
        if not probe:
            continue
        usage = shutil.disk_usage(probe)
        key = (usage.total, usage.free, os.stat(probe).st_dev)
        if key in seen:
            continue
        seen.add(key)
        facts.append({"path": path, "free_bytes": usage.free, "total_bytes": usage.total})
    return facts


def health_facts(url: str, timeout: float) -> dict:
    from urllib import error, request

    try:
        with request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback URL
            return {
                "url": url,
                "status": response.status,
                "body": response.read(200).decode(errors="replace"),
                "error": None,
            }
    except error.HTTPError as exc:
        return {"url": url, "status": exc.code, "body": None, "error": str(exc)}
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return {"url": url, "status": None, "body": None, "error": str(reason)}


class _Done:
    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value


def _run_now(function, *args) -> _Done:
    """``pool.submit`` that runs at once: the sequential baseline of :func:`gather`."""
    return _Done(function(*args))


def gather(
    python: str | None = None,
    unit: str | None = None,
    ports: list[int] | tuple[int, ...] = (),
    disk_paths: list[str] | tuple[str, ...] = (),
    health_url: str | None = None,
    probes: bool = True,
    timeout: float = 120.0,
    probe_modules=PROBE_MODULES,
    parallel: bool = True,
    checkpoints: dict | None = None,
) -> dict:
    """Collect every fact about the machine this code runs on (see the module docstring).
    ``checkpoints`` ({role: path}) overrides the unit's ``--model-path`` and
    ``--speculative-draft-model-path``."""
    python = python or shutil.which("python3") or sys.executable
    short = min(timeout, 20.0)
    env = {key: os.environ[key] for key in ENV_KEYS if key in os.environ}
    facts: dict = {
        "schema": FACTS_SCHEMA,
        "hostname": socket.gethostname(),
        "collected_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "platform": {
            "system": platform.system(),
            "machine": platform.machine(),
            "kernel": platform.release(),
        },
        "collector_python": platform.python_version(),
    }
    facts.update(interpreter_facts(python, short))
    modules = tuple(probe_modules) if probes and facts["python"]["found"] else ()
    # torch and each kernel import take seconds apiece (each imports torch): run them side by
    # side while this thread reads the quick facts; parallel=False is the sequential baseline.
    with ThreadPoolExecutor(max_workers=1 + len(modules)) as pool:
        submit = pool.submit if parallel else _run_now
        if facts["python"]["found"]:
            torch_future = submit(torch_facts, python, timeout)
        probe_futures = {name: submit(probe_one, python, timeout, name) for name in modules}
        facts["nvidia_smi"] = nvidia_smi_facts(short)
        facts["systemd"] = systemd_facts(unit, short)
        paths = {**facts["systemd"].get("checkpoint_paths", {}), **(checkpoints or {})}
        facts["checkpoints"] = checkpoint_facts(paths)
        env.update({k: v for k, v in facts["systemd"]["environment"].items() if k not in env})
        facts["env"] = env
        facts["nvcc"] = nvcc_facts(short, env)
        facts["jit_cache"] = jit_cache_facts(env)
        home = os.path.expanduser("~")
        exe_dir = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        facts["disk"] = disk_facts(list(disk_paths) + [home, exe_dir, "/"])
        facts["ports"] = port_facts(list(ports))
        facts["processes"] = process_facts(short)
        facts["health"] = health_facts(health_url, short) if health_url else None
    if facts["python"]["found"]:
        facts["torch"] = torch_future.result()
    else:
        facts["torch"] = {"installed": None, "error": "interpreter not usable: " + python}
    facts["probes"] = {name: future.result() for name, future in probe_futures.items()}
    return facts


def _arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Print this host's facts as one JSON object.")
    parser.add_argument("--python", help="the serving interpreter (default: python3 on PATH)")
    parser.add_argument("--unit", help="systemd unit to report on")
    parser.add_argument("--port", type=int, action="append", default=[], help="port to check")
    parser.add_argument("--disk", action="append", default=[], help="path whose disk to report")
    parser.add_argument("--health-url", help="URL to GET from this host (e.g. /health)")
    parser.add_argument("--no-probes", action="store_true", help="skip kernel import probes")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-subprocess timeout")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="ROLE=PATH",
                        help="target=PATH or draft=PATH: a checkpoint folder to read")  # fmt: skip
    return parser


def _options_to_argv(
    python: str | None,
    unit: str | None,
    ports,
    disk_paths,
    health_url: str | None,
    probes: bool,
    timeout: float,
    checkpoints: dict | None = None,
) -> list[str]:
    argv = []
    for role, path in sorted((checkpoints or {}).items()):
        argv += ["--checkpoint", f"{role}={path}"]
    if python:
        argv += ["--python", python]
    if unit:
        argv += ["--unit", unit]
    for port in ports:
        argv += ["--port", str(int(port))]
    for path in disk_paths:
        argv += ["--disk", str(path)]
    if health_url:
        argv += ["--health-url", health_url]
    if not probes:
        argv.append("--no-probes")
    argv += ["--timeout", str(timeout)]
    return argv


def collect_local(
    python: str | None = None,
    unit: str | None = None,
    ports=(),
    disk_paths=(),
    health_url: str | None = None,
    probes: bool = True,
    timeout: float = 120.0,
    checkpoints: dict | None = None,
) -> dict:
    """Facts about this machine (same code path as the remote collector, run in-process)."""
    return gather(python, unit, ports, disk_paths, health_url, probes, timeout,
                  checkpoints=checkpoints)  # fmt: skip


def source() -> str:
    """This script's source, as sent to ``python3 -`` on a remote host."""
    with open(os.path.abspath(__file__), encoding="utf-8") as handle:
        return handle.read()


def collect_remote(
    connection,
    python: str | None = None,
    unit: str | None = None,
    ports=(),
    disk_paths=(),
    health_url: str | None = None,
    probes: bool = True,
    timeout: float = 120.0,
    remote_python: str = "python3",
    checkpoints: dict | None = None,
) -> dict:
    """Facts about the host behind ``connection`` (anything with ``run(argv, stdin, timeout)``
    returning an object with ``returncode``, ``stdout``, ``stderr``, e.g. ``remote.ssh``'s
    Connection). Raises :class:`ddtree_cli.errors.RemoteError` when the host cannot run it.
    """
    from ddtree_cli.errors import RemoteError  # package-only import: the script stays stdlib

    argv = [remote_python, "-"] + _options_to_argv(
        python, unit, ports, disk_paths, health_url, probes, timeout, checkpoints
    )
    # Budget: interpreter + torch + each probe may each use `timeout`; plus quick commands.
    overall = timeout * (2 + (len(PROBE_MODULES) if probes else 0)) + 120
    result = connection.run(argv, stdin=source(), timeout=overall)
    stdout = result.stdout.decode() if isinstance(result.stdout, bytes) else result.stdout
    stderr = result.stderr.decode() if isinstance(result.stderr, bytes) else result.stderr
    where = getattr(connection, "label", "the host")
    if result.returncode == 127 or "No such file or directory" in (stderr or "")[:200]:
        raise RemoteError(
            f"{where}: no {remote_python} to collect facts with",
            hint="install python3 (>= 3.8) on the host",
        )
    if "SyntaxError" in (stderr or ""):
        raise RemoteError(
            f"{where}: {remote_python} is too old to collect facts (needs 3.8 or newer)",
            hint="install python3 (>= 3.8) on the host",
        )
    facts = _json_from(stdout) if result.returncode == 0 else None
    if facts is None:
        raise RemoteError(
            f"{where}: collecting host facts failed: "
            + (_last_lines(stderr, 1) or f"exit status {result.returncode}")
        )
    return facts


def main(argv: list[str] | None = None) -> int:
    args = _arg_parser().parse_args(argv)
    facts = gather(
        args.python,
        args.unit,
        args.port,
        args.disk,
        args.health_url,
        not args.no_probes,
        args.timeout,
        checkpoints=dict(item.partition("=")[::2] for item in args.checkpoint),
    )
    # One line, so a caller can take the last JSON line even if something else printed.
    sys.stdout.write(json.dumps(facts, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
