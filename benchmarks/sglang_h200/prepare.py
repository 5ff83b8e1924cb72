"""Prepare an offline bundle for running patched SGLang on a GPU machine with no network.

Run on a networked machine from the repository root (PyPI reachable):

    python benchmarks/sglang_h200/prepare.py --out runs/sglang_h200 [--sglang 0.5.17] \
        [--trained ENGINE_FOLDER]

Steps (each cached or skipped when its output exists):
1. wheels: ``pip download --no-deps --only-binary=:all:`` for CPython 3.12 / manylinux x86_64
   of exactly the pins in the release's list (``wheels-cp312.txt`` for 0.5.13,
   ``wheels-cp312-<version>.txt`` otherwise) into ``<wheel cache>/cp312``; members Python
   never loads (a static archive) are left out, and with ``--slim-kernel`` the sgl_kernel
   binaries a triton-backend server on sm90 never loads;
2. site: those wheels, except SGLang itself, installed here with ``pip install --no-deps
   --target`` for CPython 3.12 (what the GPU machine would do, minus its time there);
3. snapshot: the cp312 ``sglang==<version>`` wheel extracted and patched by ``ddtree patch``
   (``python -m ddtree_cli patch``), checked ``applied`` (a cached snapshot patched by another
   version of the series is extracted and patched afresh); its ``sglang/`` package and
   ``sglang-<version>.dist-info`` are packed, so no stock copy of SGLang travels. ``--stock``
   packs the release unpatched (plain and DFLASH only: a check of the wheel list and flags
   on the GPU before a series for the release exists);
4. checkpoints: the engine's fixed-seed random pair exported for SGLang (bf16) once per draft
   block size 9, 16, 33 and 65 (one target, ``draft-b<N>`` per block size; the DDTREE
   budget is free of the block size in the 0.5.13 series, so ``draft-b16`` serves budgets 8
   to 64 there and budgets of at least 15 in the v2 layout (0.5.14 on); the others give each
   budget a draft of block budget + 1 to compare with), and the
   trained pair when ``--trained`` is given; ``--no-random`` leaves the random pair out;
5. the ``ddtree_cli`` package without the embedded engine's weights, ``run.py`` and ``units.py``
   (the bench client and deploy's unit rendering run from the bundle), and ``prompts/heldout.jsonl``: byte-token prompts cut from
   the stdlib files the trained pair never saw (its held-out split), for the trained pair's
   ``agree`` and ``bench`` steps; ``contents.json`` says what the bundle holds (``run.py``
   reads the SGLang version from it);
6. one xz-compressed tar of all that, split into pieces of at most ``--piece-mib`` MiB
   (default 36: one piece plus a checkout of this repository, ~27 MB, stays under a 64 MiB
   transfer) with ``manifest.json``: every piece's size and sha256, and the whole tar's
   sha256.

On the GPU machine, ``run.py`` reassembles and verifies the pieces; see docs/validation.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from ddtree_cli.engine.export import export_pair, random_export_pair  # noqa: E402
from ddtree_cli.engine.tokenizer import ByteTokenizer  # noqa: E402
from ddtree_cli.engine.weights import load_pair  # noqa: E402
from ddtree_cli.patching import fetch  # noqa: E402
from ddtree_cli.training.corpus import is_heldout  # noqa: E402

DEFAULT_SGLANG = "0.5.13"
# One pinned wheel list per release that runs on the GPU image (torch 2.11: 0.5.13-0.5.17).
PIN_LISTS = {"0.5.13": "wheels-cp312.txt", "0.5.17": "wheels-cp312-0.5.17.txt"}
BLOCK_SIZES = (9, 16, 33, 65)  # draft-b16 for any budget; b9/b33/b65: budget = block - 1
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")  # fmt: skip
MIB = 1 << 20
# --broken-kernel: a kernel built for another torch than 2.11 (sgl-project/sglang issue 36462:
# 0.4.6.post1 next to torch 2.11 fails at import with an undefined symbol), for
# doctor_states.sh's "broken" state. Slimmed like --slim-kernel (its sm90 common_ops, where
# the symbol is missing, stays).
BROKEN_KERNEL_PIN = "sglang-kernel==0.4.6.post1"
XZ_PRESET = 6  # xz over the installed files: about half the size of the same wheels zipped


def pins_path(version: str) -> Path:
    if version not in PIN_LISTS:
        raise SystemExit(f"no wheel list for SGLang {version} (have: {', '.join(PIN_LISTS)}); "
                         f"write {HERE.name}/wheels-cp312-{version}.txt first")  # fmt: skip
    return HERE / PIN_LISTS[version]


def read_pins(path: Path = HERE / PIN_LISTS[DEFAULT_SGLANG]) -> list[str]:
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(line)
    return pins


def release_pins(version: str) -> list[str]:
    """The release's pin list, which must pin that very release of SGLang."""
    pins = read_pins(pins_path(version))
    if f"sglang=={version}" not in pins:
        raise SystemExit(f"{PIN_LISTS[version]} does not pin sglang=={version}")
    return pins


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_for(pin: str, folder: Path) -> Path | None:
    """The downloaded wheel matching ``name==version`` in ``folder``, if any."""
    name, version = pin.split("==")
    for wheel in folder.glob("*.whl"):
        parts = wheel.name.split("-")
        if _norm(parts[0]) == _norm(name) and parts[1] == version:
            return wheel
    return None


def _platform_args() -> list[str]:
    args = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def download_wheels(pins: list[str], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    missing = [p for p in pins if wheel_for(p, folder) is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *_platform_args(),
               "--quiet", "--disable-pip-version-check", "-d", str(folder)]  # fmt: skip
        subprocess.run([*cmd, *missing], check=True)
    wheels = [wheel_for(p, folder) for p in pins]
    absent = [p for p, w in zip(pins, wheels, strict=True) if w is None]
    if absent:
        raise SystemExit(f"pip did not produce wheels for: {', '.join(absent)}")
    return [w for w in wheels if w is not None]


# --slim-kernel (and --smoke): sgl_kernel binaries a triton-backend server on an H100/H200
# (sm90) never loads: FA3 (imported only by the fa3 attention backend), FlashMLA (MLA models),
# the sm100 build, and from sglang-kernel 0.4.5 InfLLM-V2's extension (loaded by
# `load_infllm_ops()` on first use only). They are ~95 % of that wheel. Confirmed on an H200
# on 2026-11-30 for sglang-kernel 0.4.3: plain, DFLASH and DDTREE servers started, captured
# CUDA graphs and served from the slimmed wheel. Members a wheel lacks are skipped.
KERNEL_DROP = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so",
               "sgl_kernel/sm100/common_ops.abi3.so",
               "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so")  # fmt: skip
# Left out of every bundle: files no Python process loads (xgrammar's static library for C++
# builds, 31 of its wheel's 45 MB; the bindings it imports are a separate .so).
NEVER_LOADED = {"xgrammar": ("xgrammar/lib/libxgrammar.a",)}
SMOKE_SKIP_PINS = ("paramiko", "bcrypt", "cryptography", "pynacl", "invoke")


def slim_wheel(wheel: Path, out_dir: Path, drop: tuple[str, ...] = KERNEL_DROP) -> Path:
    """A copy of ``wheel`` without the ``drop`` members (and their RECORD lines)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    if out.is_file():
        return out
    tmp = out.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if ln.split(",")[0] not in drop).encode()
            dst.writestr(info, data)
    tmp.rename(out)
    return out


def bundle_wheels(wheels: list[Path], work: Path, slim_kernel: bool) -> list[Path]:
    """The wheels as they go into the site: never-loaded members dropped, the kernel slimmed
    on request. A wheel with nothing to drop is used as downloaded."""
    out = []
    for wheel in wheels:
        name = _norm(wheel.name.split("-")[0])
        drop = NEVER_LOADED.get(name, ())
        if slim_kernel and name == "sglang_kernel":
            drop += KERNEL_DROP
        with zipfile.ZipFile(wheel) as z:
            present = tuple(d for d in drop if d in set(z.namelist()))
        key = hashlib.sha256("\n".join(present).encode()).hexdigest()[:8]
        out.append(slim_wheel(wheel, work / f"slim-{key}", present) if present else wheel)
    return out


def install_site(wheels: list[Path], work: Path) -> Path:
    """``pip install --no-deps --target`` of ``wheels`` for CPython 3.12 / manylinux, cached by
    the set of wheels (a changed list installs afresh into a new folder)."""
    key = hashlib.sha256("\n".join(sorted(w.name for w in wheels)).encode()).hexdigest()[:12]
    site = work / f"site-{key}"
    if (site / ".complete").is_file():
        return site
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-compile", "--disable-pip-version-check", "--target", str(site),
                    *_platform_args(), *map(str, wheels)], check=True)  # fmt: skip
    (site / ".complete").write_text("\n".join(w.name for w in wheels) + "\n")
    return site


def patched_snapshot(sglang_wheel: Path, work: Path, stock: bool = False) -> Path:
    """Extract the cp312 SGLang wheel and apply the DDTREE series with ``ddtree patch``
    (``stock``: extract only)."""
    version = sglang_wheel.name.split("-")[1]
    root = work / f"sglang-{version}{'-stock' if stock else ''}"
    if stock:
        if not (root / "sglang").is_dir():
            shutil.rmtree(root, ignore_errors=True)
            fetch.extract_wheel(sglang_wheel, root)
        return root
    fresh = not (root / ".ddtree").is_dir()
    for _ in range(2):
        if fresh:
            shutil.rmtree(root, ignore_errors=True)
            fetch.extract_wheel(sglang_wheel, root)
            _ddtree(["patch", str(root), "--json"])
        state = _patch_state(root)
        if state == "applied":
            return root
        if fresh:
            break
        # A snapshot cached from another version of the series: extract and patch afresh.
        fresh = True
    raise SystemExit(f"{root}: patch state is {state!r}, not applied")


def _patch_state(root: Path) -> str | None:
    """``applied``, ``pristine`` or ``drifted`` (``--check`` exits non-zero unless applied)."""
    proc = subprocess.run([sys.executable, "-m", "ddtree_cli", "patch", str(root), "--check",
                           "--json"], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    try:
        return json.loads(proc.stdout).get("state")
    except json.JSONDecodeError:
        raise SystemExit(f"ddtree patch --check {root} failed: {proc.stderr.strip()}") from None


def _ddtree(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "ddtree_cli", *args], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"ddtree {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def export_checkpoints(
    work: Path, trained: Path | None, blocks: tuple[int, ...] = BLOCK_SIZES
) -> list[Path]:
    """``ckpt/random``: one target and a draft per block size (``draft-b<N>``); the drafts
    differ only in ``block_size``, so the target is exported once. No ``blocks``: no random
    pair."""
    out = []
    random_dir = work / "ckpt" / ("random" if blocks == BLOCK_SIZES else "random-smoke")
    if blocks and not all((random_dir / f"draft-b{b}" / "config.json").is_file() for b in blocks):
        shutil.rmtree(random_dir, ignore_errors=True)
        for block in blocks:
            tmp = work / "ckpt" / f".export-b{block}"
            shutil.rmtree(tmp, ignore_errors=True)
            export_pair(random_export_pair(block_size=block), tmp, dtype="bfloat16")
            if not random_dir.exists():
                random_dir.mkdir(parents=True)
                (tmp / "target").rename(random_dir / "target")
            (tmp / "draft").rename(random_dir / f"draft-b{block}")
            (tmp / "export.json").rename(random_dir / f"export-b{block}.json")
            shutil.rmtree(tmp)
    if blocks:
        out.append(random_dir)
    if trained is not None:
        folder = work / "ckpt" / "trained"
        shutil.rmtree(folder, ignore_errors=True)
        export_pair(load_pair(trained), folder, dtype="bfloat16")
        out.append(folder)
    return out


def heldout_prompts(
    count: int, length: int, root: Path | None = None, per_file: int = 16
) -> list[list[int]]:
    """``count`` prompts of ``length`` byte tokens from the held-out stdlib files (the split
    the trained pair was evaluated on, never trained on): up to ``per_file`` windows starting
    at line starts, spread evenly through each file, taken round-robin over the files in path
    order."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    tok = ByteTokenizer()
    windows = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if {"site-packages", "__pycache__"} & set(rel.parts) or not is_heldout(rel.as_posix()):
            continue
        try:
            ids = tok.encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        starts = [0] + [i + 1 for i, b in enumerate(ids[:-length]) if b == 0x0A]
        starts = [s for s in starts if s + length <= len(ids)]
        if starts:
            step = max(1, len(starts) // per_file)
            windows.append([ids[s : s + length] for s in starts[::step][:per_file]])
    out: list[list[int]] = []
    for rank in range(per_file):
        out += [w[rank] for w in windows if rank < len(w)]
    if len(out) < count:
        raise SystemExit(f"only {len(out)} held-out prompts of {length} tokens under {root}")
    return out[:count]


# The bench client needs ddtree_cli's code, not the embedded engine's weights (23 MB).
CLIENT_SKIP = ("ddtree_cli/engine/embedded",)


def build_tar(tar_path: Path, site: Path, snapshot: Path, ckpts: list[Path], contents: dict,
              prompt_file: Path | None = None, extra: list[Path] = ()) -> None:  # fmt: skip
    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if "__pycache__" in info.name or info.name.endswith(".pyc"):
            return None
        if info.name.startswith("site/") and info.name.endswith("/.complete"):
            return None
        if any(info.name == f"client/{s}" or info.name.startswith(f"client/{s}/")
               for s in CLIENT_SKIP):  # fmt: skip
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    meta = tar_path.with_name("contents.json")
    meta.write_text(json.dumps(contents, indent=1) + "\n")
    with tarfile.open(tar_path, "w:xz", preset=XZ_PRESET) as tar:
        tar.add(meta, "contents.json", filter=clean)
        tar.add(site, "site", filter=clean)
        tar.add(snapshot / "sglang", "snapshot/sglang", filter=clean)
        for info in sorted(snapshot.glob("sglang-*.dist-info")):
            tar.add(info, f"snapshot/{info.name}", filter=clean)
        for ckpt in ckpts:
            tar.add(ckpt, f"ckpt/{ckpt.name.removesuffix('-smoke')}", filter=clean)
        tar.add(REPO / "ddtree_cli", "client/ddtree_cli", filter=clean)
        tar.add(HERE / "run.py", "run.py", filter=clean)
        tar.add(HERE / "units.py", "units.py", filter=clean)
        if prompt_file is not None:
            tar.add(prompt_file, f"prompts/{prompt_file.name}", filter=clean)
        for wheel in extra:  # not installed by run.py install; doctor_states.sh uses them
            tar.add(wheel, f"extra/{wheel.name}", filter=clean)


def split(tar_path: Path, out: Path, piece_mib: int) -> dict:
    whole = hashlib.sha256()
    pieces = []
    with tar_path.open("rb") as f:
        index = 0
        while chunk := f.read(piece_mib * MIB):
            whole.update(chunk)
            name = f"bundle.tar.{index:03d}"
            (out / name).write_bytes(chunk)
            pieces.append({"name": name, "bytes": len(chunk),
                           "sha256": hashlib.sha256(chunk).hexdigest()})  # fmt: skip
            index += 1
    return {"format": 2, "tar_sha256": whole.hexdigest(), "tar_bytes": tar_path.stat().st_size,
            "pieces": pieces}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "sglang_h200")
    p.add_argument("--sglang", default=DEFAULT_SGLANG, metavar="VERSION",
                   help=f"the SGLang release ({', '.join(PIN_LISTS)}; default "
                   f"{DEFAULT_SGLANG})")  # fmt: skip
    p.add_argument("--stock", action="store_true",
                   help="pack the release unpatched (plain and DFLASH only)")  # fmt: skip
    p.add_argument("--wheels", type=Path, default=fetch.wheel_cache_dir() / "cp312")
    p.add_argument("--trained", type=Path, help="an engine model folder (the trained pair)")
    p.add_argument("--no-random", action="store_true",
                   help="leave the random pair out (with --trained: the trained pair only)")  # fmt: skip
    p.add_argument("--piece-mib", type=int, default=36)
    p.add_argument("--smoke", action="store_true",
                   help="a small bundle for one DDTREE smoke run: the --slim-kernel sgl_kernel, "
                   "no SSH client wheels, only the block-16 random pair")  # fmt: skip
    p.add_argument("--slim-kernel", action="store_true",
                   help="sgl_kernel without FA3/FlashMLA/sm100/InfLLM binaries (enough for the "
                   "triton attention backend on sm90), everything else as in the full bundle")  # fmt: skip
    p.add_argument("--no-ssh", action="store_true",
                   help="leave out the SSH client wheels (`ddtree bench --url` does not need them)")  # fmt: skip
    p.add_argument("--broken-kernel", action="store_true",
                   help=f"also carry {BROKEN_KERNEL_PIN} and the release's own kernel wheel "
                   "(slimmed like the bundle's) under extra/ for doctor_states.sh's broken and "
                   "repaired states")  # fmt: skip
    args = p.parse_args(argv)
    if args.no_random and args.trained is None:
        p.error("--no-random needs --trained (a bundle needs a checkpoint)")
    pins = release_pins(args.sglang)  # refuses a release with no list before any download
    if not (REPO / "ddtree_cli" / "bench").is_dir():
        print("warning: this checkout has no ddtree_cli/bench; `run.py bench` needs a bundle "
              "made from a checkout that has `ddtree bench`", file=sys.stderr)  # fmt: skip
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    wheels = download_wheels(pins, args.wheels)
    sglang = wheel_for(f"sglang=={args.sglang}", args.wheels)
    assert sglang is not None
    # The snapshot first: a release `ddtree patch` cannot patch fails before the slow steps.
    snapshot = patched_snapshot(sglang, work, stock=args.stock)
    print(f"snapshot: {snapshot} ({'stock' if args.stock else 'patched'})")
    wheels = [w for w in wheels if w != sglang]  # the snapshot carries the package itself
    if args.smoke or args.no_ssh:
        wheels = [w for w in wheels if _norm(w.name.split("-")[0]) not in SMOKE_SKIP_PINS]
    slim = args.smoke or args.slim_kernel
    wheels = bundle_wheels(wheels, work, slim_kernel=slim)
    site = install_site(wheels, work)
    print(f"site: {len(wheels)} wheels ({sum(w.stat().st_size for w in wheels) / MIB:.0f} MiB "
          f"zipped) installed in {site}")  # fmt: skip
    blocks = () if args.no_random else (16,) if args.smoke else BLOCK_SIZES
    ckpts = export_checkpoints(work, args.trained, blocks)
    print("checkpoints: " + ", ".join(c.name.removesuffix("-smoke") for c in ckpts))
    pieces_dir = args.out / "pieces"
    shutil.rmtree(pieces_dir, ignore_errors=True)
    pieces_dir.mkdir()
    prompt_file = None
    if args.trained is not None:
        prompt_file = work / "heldout.jsonl"
        rows = heldout_prompts(200, 64)
        prompt_file.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
        print(f"prompts: {len(rows)} held-out windows of 64 tokens")
    extra = []
    if args.broken_kernel:
        extra = [slim_wheel(w, work / "slim-extra")
                 for w in download_wheels([BROKEN_KERNEL_PIN], args.wheels)]  # fmt: skip
        # and the release's own kernel as a wheel: the site holds it installed, but the
        # "repaired" state applies doctor's pip fix offline, which needs the wheel file
        extra += [w for w in wheels if w.name.startswith("sglang_kernel-")]
        print("extra: " + ", ".join(w.name for w in extra))
    contents = {
        "sglang": args.sglang,
        "patched": not args.stock,
        "smoke": args.smoke,
        "slim_kernel": slim,
        "wheels": [w.name for w in wheels],
        "checkpoints": [c.name.removesuffix("-smoke") for c in ckpts],
        "prompts": [] if prompt_file is None else [prompt_file.stem],
        "extra": [w.name for w in extra],
    }
    tar_path = work / "bundle.tar.xz"
    build_tar(tar_path, site, snapshot, ckpts, contents, prompt_file, extra)
    manifest = split(tar_path, pieces_dir, args.piece_mib)
    manifest["contents"] = contents
    (pieces_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    os.unlink(tar_path)
    print(f"pieces: {len(manifest['pieces'])} in {pieces_dir} "
          f"({manifest['tar_bytes'] / MIB:.0f} MiB, sha256 {manifest['tar_sha256'][:12]}…)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
