"""Maintainers: add (or rebuild) the patch series of one SGLang release.

    python -m ddtree_cli.patching.regenerate VERSION [--from SERIES] [--edited DIR] [--work DIR]

Without ``--edited``: downloads the release wheel, extracts it under ``--work`` (default
``./ddtree-series-VERSION``) as ``pristine/`` and ``edited/``, and ports the nearest
shipped series (the one with the fewest hunks that miss, or ``--from SERIES``) onto
``edited/`` hunk by hunk, each by its context. When every hunk finds
a unique anchor the series is written at once. Otherwise the hunks that did not apply are
listed, nothing is written, and the command exits 1: make those changes in ``edited/``
by hand (the family files are already there), then run it again with ``--edited``.

With ``--edited DIR`` (a tree holding ``sglang/``, the release plus DDTREE): every SGLang
file that differs from the release goes into ``series/VERSION/release.patch``, every
family file that differs from the shipped one becomes a hunk against it there too, and
``series.json`` records the release's SHA-256 of each SGLang file touched.

A release whose touched files are byte-identical to a shipped series' release gets no
series of its own: it is recorded as using that series.

Either way the release is added to ``tests/patch/releases.json``, the table the wheel
tests are parametrised from, so its apply/check/revert/export tests run from then on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ddtree_cli.errors import DdtreeError
from ddtree_cli.patching import fetch, recognise, snapshot, unidiff
from ddtree_cli.patching import series as series_mod
from ddtree_cli.patching.series import VENDORED, sha256

RELEASES_TABLE = Path(__file__).resolve().parents[2] / "tests" / "patch" / "releases.json"


def _py_files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in (root / "sglang").rglob("*.py")
        if "__pycache__" not in p.parts
    }


def port(base: series_mod.Series, pristine: Path, edited: Path) -> list[str]:
    """Write ``base``'s changes onto ``edited`` (a copy of ``pristine``), each hunk by its
    context; the hunks that found no unique anchor are skipped and returned."""
    problems: list[str] = []
    for rel, diff in sorted(base.diffs.items()):
        path = edited / rel
        if not path.is_file():
            problems.append(f"{rel}: missing in this release ({len(diff.hunks)} hunks)")
            continue
        text = path.read_text(encoding="utf-8")
        for number, hunk in enumerate(diff.hunks, 1):
            one = unidiff.FileDiff(path=rel, hunks=[hunk])
            try:
                text = unidiff.apply(text, one, fuzzy=True)
            except unidiff.DiffError as exc:
                reason = str(exc).split(": ", 1)[-1].replace("of hunk 1 ", "")
                problems.append(f"{rel}: hunk {number} ({reason})")
        path.write_text(text, encoding="utf-8")
    for rel in [*base.new_files, *VENDORED]:
        target = edited / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base.new_content(rel))
    return problems


def write_series(
    version: str, layout: str, pristine: Path, edited: Path, out: Path | None = None
) -> Path:
    before, after = _py_files(pristine), _py_files(edited)
    family = series_mod.family_files(layout)
    pristine_hashes: dict[str, str] = {}
    chunks: list[str] = []
    for rel in sorted(after):
        if rel in VENDORED:
            continue
        if rel in family:
            if after[rel].decode() != family[rel]:  # this release's change to a family file
                chunks.append(unidiff.make(rel, family[rel], after[rel].decode()))
            continue
        old = before.get(rel)
        if old == after[rel]:
            continue
        if old is None:
            raise DdtreeError(
                f"{rel} is new but is no family file",
                hint="add files DDTREE needs to series/families/<layout>/ (or common/)",
            )
        pristine_hashes[rel] = sha256(old)
        chunks.append(unidiff.make(rel, old.decode(), after[rel].decode()))
    missing = [rel for rel in family if rel not in after]
    if missing:
        raise DdtreeError(f"the edited tree lacks family files: {', '.join(missing)}")
    release_patch = "".join(chunks)
    # The diff must give back the edited tree from the release, file by file.
    for diff in unidiff.parse(release_patch):
        if diff.path in family:
            continue
        if unidiff.apply(before[diff.path].decode(), diff).encode() != after[diff.path]:
            raise DdtreeError(f"the diff of {diff.path} does not reproduce the edited file")
    out = out or series_mod.series_dir_on_disk(version)
    out.mkdir(parents=True, exist_ok=True)
    (out / series_mod.RELEASE_PATCH).write_text(release_patch, encoding="utf-8")
    meta = {"version": version, "layout": layout, "pristine": pristine_hashes}
    (out / series_mod.SERIES_JSON).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    series_mod.load.cache_clear()
    return out


def add_to_release_table(
    version: str, layout: str, series_version: str, table_path: Path = RELEASES_TABLE
) -> None:
    """One line per release, in version order."""
    table = json.loads(table_path.read_text(encoding="utf-8")) if table_path.is_file() else {}
    table[version] = {"layout": layout, "series": series_version}
    lines = [
        f"  {json.dumps(v)}: {json.dumps(table[v])}"
        for v in sorted(table, key=series_mod.version_key)
    ]
    table_path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")


def regenerate(
    version: str,
    work: Path,
    edited: Path | None = None,
    *,
    out: Path | None = None,
    table: Path = RELEASES_TABLE,
    base: str | None = None,
) -> tuple[Path, list[str]]:
    """(the series folder or the work folder, the hunks still to port by hand)."""
    pristine = work / "pristine"
    if not (pristine / "sglang").is_dir():
        shutil.rmtree(pristine, ignore_errors=True)
        fetch.extract_wheel(fetch.download_wheel(version), pristine)
    snap = snapshot.detect(pristine)
    if edited is None:
        try:
            match = recognise.identify(snap)
        except DdtreeError:
            match = None
        known = match is not None and match.how == "content"
        if known and base is None and match.series.version != version:
            # e.g. 0.5.13.post1, whose files are 0.5.13's: it uses that series
            add_to_release_table(version, snap.layout.value, match.series.version, table)
            return series_mod.series_dir_on_disk(match.series.version), []
        edited = work / "edited"
        shutil.rmtree(edited, ignore_errors=True)
        shutil.copytree(pristine, edited, symlinks=True)
        # Rebuilding a shipped series ports another one onto it (--from, or the nearest).
        source = series_mod.load(base) if base else recognise.nearest(snap, exclude=version)[0]
        problems = port(source, pristine, edited)
        if problems:
            return edited, [f"ported from series {source.version}; still to do by hand:", *problems]
    written = write_series(version, snap.layout.value, pristine, edited, out)
    add_to_release_table(version, snap.layout.value, version, table)
    return written, []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree_cli.patching.regenerate")
    parser.add_argument("version")
    parser.add_argument("--from", dest="base", help="the series to port (default: nearest)")
    parser.add_argument("--edited", type=Path, help="a finished tree: write its series")
    parser.add_argument("--work", type=Path, help="work folder (default ./ddtree-series-V)")
    args = parser.parse_args(argv)
    work = (args.work or Path.cwd() / f"ddtree-series-{args.version}").resolve()
    try:
        where, todo = regenerate(args.version, work, args.edited, base=args.base)
    except DdtreeError as exc:
        print(f"error: {exc}" + (f" ({exc.hint})" if exc.hint else ""), file=sys.stderr)
        return 1
    if todo:
        print("\n".join(todo), file=sys.stderr)
        print(f"edit {where}, then: python -m ddtree_cli.patching.regenerate "
              f"{args.version} --edited {where} --work {work}", file=sys.stderr)  # fmt: skip
        return 1
    print(where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
