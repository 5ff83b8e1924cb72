"""Prepare an offline bundle for running patched SGLang 0.5.13 on a GPU machine with no network.

Run on a networked machine from the repository root (PyPI reachable):

    python benchmarks/sglang_h200/prepare.py --out runs/sglang_h200 [--trained ENGINE_FOLDER]

Steps (each cached or skipped when its output exists):
1. wheels: ``pip download --no-deps --only-binary=:all:`` for CPython 3.12 / manylinux x86_64
   of exactly the pins in ``wheels-cp312.txt`` into ``<wheel cache>/cp312``;
2. snapshot: the cp312 ``sglang==0.5.13`` wheel extracted and patched by ``ddtree patch``
   (``python -m ddtree_cli patch``), checked ``applied`` (a cached snapshot patched by another
   version of the series is extracted and patched afresh); only its ``sglang/`` package is
   packed;
3. checkpoints: the engine's fixed-seed random pair exported for SGLang (bf16) once per draft
   block size 9, 16, 33 and 65 (one target, ``draft-b<N>`` per block size; the DDTREE
   budget is free of the block size, so ``draft-b16`` serves budgets 8 to 64, the others
   give each budget a draft of block budget + 1 to compare with), and the trained pair
   when ``--trained`` is given;
4. the ``ddtree_cli`` package, ``run.py`` and ``units.py`` (the bench client and deploy's unit
   rendering run from the bundle), and
   ``prompts/heldout.jsonl``: byte-token prompts cut from the stdlib files the trained pair
   never saw (its held-out split), for the trained pair's ``agree`` and ``bench`` steps;
5. one gzipped tar of all that, split into pieces of at most ``--piece-mib`` MiB (default 36:
   one piece plus a checkout of this repository, ~24 MB, stays under a 64 MiB transfer) with
   ``manifest.json``: every piece's size and sha256, and the whole tar's sha256.

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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from ddtree_cli.engine.export import export_pair, random_export_pair  # noqa: E402
from ddtree_cli.engine.tokenizer import ByteTokenizer  # noqa: E402
from ddtree_cli.engine.weights import load_pair  # noqa: E402
from ddtree_cli.patching import fetch  # noqa: E402
from ddtree_cli.training.corpus import is_heldout  # noqa: E402

SGLANG_VERSION = "0.5.13"
BLOCK_SIZES = (9, 16, 33, 65)  # draft-b16 for any budget; b9/b33/b65: budget = block - 1
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")  # fmt: skip
MIB = 1 << 20
# --broken-kernel: a kernel built for another torch than 2.11 (sgl-project/sglang issue 36462:
# 0.4.6.post1 next to torch 2.11 fails at import with an undefined symbol), for
# doctor_states.sh's "broken" state. Slimmed like --slim-kernel (its sm90 common_ops, where
# the symbol is missing, stays).
BROKEN_KERNEL_PIN = "sglang-kernel==0.4.6.post1"


def read_pins(path: Path = HERE / "wheels-cp312.txt") -> list[str]:
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(line)
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


def download_wheels(pins: list[str], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    missing = [p for p in pins if wheel_for(p, folder) is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "--quiet",
               "--disable-pip-version-check", "-d", str(folder)]  # fmt: skip
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run([*cmd, *missing], check=True)
    wheels = [wheel_for(p, folder) for p in pins]
    absent = [p for p, w in zip(pins, wheels, strict=True) if w is None]
    if absent:
        raise SystemExit(f"pip did not produce wheels for: {', '.join(absent)}")
    return [w for w in wheels if w is not None]


# --slim-kernel (and --smoke): sgl_kernel binaries a triton-backend server on an H100/H200
# (sm90) never loads: FA3 (imported only by the fa3 attention backend), FlashMLA (MLA models)
# and the sm100 build. They are ~2/3 of the bundle. Confirmed on an H200 on 2026-11-30: plain,
# DFLASH and DDTREE servers started, captured CUDA graphs and served from the slimmed wheel.
SMOKE_DROP = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so",
              "sgl_kernel/sm100/common_ops.abi3.so")  # fmt: skip
SMOKE_SKIP_PINS = ("paramiko", "bcrypt", "cryptography", "pynacl", "invoke")


def slim_wheel(wheel: Path, out_dir: Path, drop: tuple[str, ...] = SMOKE_DROP) -> Path:
    """A copy of ``wheel`` without the ``drop`` members (and their RECORD lines)."""
    import zipfile

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


def patched_snapshot(sglang_wheel: Path, work: Path) -> Path:
    """Extract the cp312 SGLang wheel and apply the DDTREE series with ``ddtree patch``."""
    root = work / f"sglang-{SGLANG_VERSION}"
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
    differ only in ``block_size``, so the target is exported once."""
    random_dir = work / "ckpt" / ("random" if blocks == BLOCK_SIZES else "random-smoke")
    if not all((random_dir / f"draft-b{b}" / "config.json").is_file() for b in blocks):
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
    out = [random_dir]
    if trained is not None:
        folder = work / "ckpt" / "trained"
        shutil.rmtree(folder, ignore_errors=True)
        export_pair(load_pair(trained), folder, dtype="bfloat16")
        out.append(folder)
    return out


def heldout_prompts(count: int, length: int, root: Path | None = None) -> list[list[int]]:
    """``count`` prompts of ``length`` byte tokens from the held-out stdlib files (the split
    the trained pair was evaluated on, never trained on): windows starting at line starts,
    spread evenly through each file, taken round-robin over the files in path order."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    tok = ByteTokenizer()
    per_file = []
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
            step = max(1, len(starts) // 16)
            per_file.append([ids[s : s + length] for s in starts[::step][:16]])
    out: list[list[int]] = []
    for rank in range(16):
        out += [windows[rank] for windows in per_file if rank < len(windows)]
    if len(out) < count:
        raise SystemExit(f"only {len(out)} held-out prompts of {length} tokens under {root}")
    return out[:count]


def build_tar(tar_path: Path, wheels: list[Path], snapshot: Path, ckpts: list[Path],
              prompt_file: Path | None = None, extra: list[Path] = ()) -> None:  # fmt: skip
    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if "__pycache__" in info.name or info.name.endswith(".pyc"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    # Level 1: the wheels are compressed already; the snapshot's source shrinks fivefold.
    with tarfile.open(tar_path, "w:gz", compresslevel=1) as tar:
        for wheel in wheels:
            tar.add(wheel, f"wheels/{wheel.name}", filter=clean)
        tar.add(snapshot / "sglang", "snapshot/sglang", filter=clean)
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
            name = f"bundle.tgz.{index:03d}"
            (out / name).write_bytes(chunk)
            pieces.append({"name": name, "bytes": len(chunk),
                           "sha256": hashlib.sha256(chunk).hexdigest()})  # fmt: skip
            index += 1
    return {"format": 1, "tar_sha256": whole.hexdigest(), "tar_bytes": tar_path.stat().st_size,
            "pieces": pieces}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "sglang_h200")
    p.add_argument("--wheels", type=Path, default=fetch.wheel_cache_dir() / "cp312")
    p.add_argument("--trained", type=Path, help="an engine model folder (the trained pair)")
    p.add_argument("--piece-mib", type=int, default=36)
    p.add_argument("--smoke", action="store_true",
                   help="a small bundle for one DDTREE smoke run: sgl_kernel without FA3/FlashMLA/"
                   "sm100 binaries, no SSH client wheels, only the block-16 random pair")  # fmt: skip
    p.add_argument("--slim-kernel", action="store_true",
                   help="sgl_kernel without FA3/FlashMLA/sm100 binaries (enough for the triton "
                   "attention backend on sm90), everything else as in the full bundle")  # fmt: skip
    p.add_argument("--broken-kernel", action="store_true",
                   help=f"also carry {BROKEN_KERNEL_PIN} (slimmed) under extra/ for "
                   "doctor_states.sh's broken state")  # fmt: skip
    args = p.parse_args(argv)
    if not (REPO / "ddtree_cli" / "bench").is_dir():
        print("warning: this checkout has no ddtree_cli/bench; `run.py bench` needs a bundle "
              "made from a checkout that has `ddtree bench`", file=sys.stderr)  # fmt: skip
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    pins = read_pins()
    wheels = download_wheels(pins, args.wheels)
    if args.smoke:
        wheels = [w for w in wheels if _norm(w.name.split("-")[0]) not in SMOKE_SKIP_PINS]
    if args.smoke or args.slim_kernel:
        wheels = [slim_wheel(w, work / "slim") if w.name.startswith("sglang_kernel-") else w
                  for w in wheels]  # fmt: skip
    print(f"wheels: {len(wheels)} ({sum(w.stat().st_size for w in wheels) / MIB:.0f} MiB)")
    sglang = wheel_for(f"sglang=={SGLANG_VERSION}", args.wheels)
    assert sglang is not None
    snapshot = patched_snapshot(sglang, work)
    print(f"snapshot: {snapshot} (patched)")
    ckpts = export_checkpoints(work, args.trained, (16,) if args.smoke else BLOCK_SIZES)
    print("checkpoints: " + ", ".join(c.name for c in ckpts))
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
        print("extra: " + ", ".join(w.name for w in extra))
    tar_path = work / "bundle.tgz"
    build_tar(tar_path, wheels, snapshot, ckpts, prompt_file, extra)
    manifest = split(tar_path, pieces_dir, args.piece_mib)
    manifest["contents"] = {
        "sglang": SGLANG_VERSION,
        "smoke": args.smoke,
        "slim_kernel": args.smoke or args.slim_kernel,
        "wheels": [w.name for w in wheels],
        "checkpoints": [c.name for c in ckpts],
        "extra": [w.name for w in extra],
    }
    (pieces_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    os.unlink(tar_path)
    print(f"pieces: {len(manifest['pieces'])} in {pieces_dir} "
          f"({manifest['tar_bytes'] / MIB:.0f} MiB, sha256 {manifest['tar_sha256'][:12]}…)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
