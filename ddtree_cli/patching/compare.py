"""What one release's series changes that another's does not, line numbers and context aside.

    python -m ddtree_cli.patching.compare 0.5.19 0.5.20

Each series' hunks are reduced to their changes (the removed and added lines of each hunk,
in order); the output lists, per file, the changes only the first series makes (``-``)
and those only the second makes (``+``), and the files only one of them touches. Two
releases that need the same DDTREE edits print nothing but the header, however far apart
their line numbers.
"""

from __future__ import annotations

import sys
from collections import Counter

from ddtree_cli.errors import DdtreeError
from ddtree_cli.patching import series as series_mod
from ddtree_cli.patching import unidiff


def _changes(diff: unidiff.FileDiff) -> list[str]:
    """One text per hunk: its removed and added lines, without context or positions."""
    return ["".join(ln for ln in hunk.lines if ln[0] in "+-") for hunk in diff.hunks]


def compare(a: str, b: str) -> list[str]:
    """Report lines (see the module docstring)."""
    sa, sb = series_mod.load(a), series_mod.load(b)
    lines = [f"series {a} ({sa.layout}) -> series {b} ({sb.layout})"]
    for label, files in ((f"only {a}", sorted(set(sa.diffs) - set(sb.diffs))),
                         (f"only {b}", sorted(set(sb.diffs) - set(sa.diffs)))):  # fmt: skip
        lines += [f"{label}: {rel}" for rel in files]
    for rel in sorted(set(sa.diffs) & set(sb.diffs)):
        ca, cb = Counter(_changes(sa.diffs[rel])), Counter(_changes(sb.diffs[rel]))
        gone, new = ca - cb, cb - ca
        if not gone and not new:
            continue
        lines.append(f"{rel}:")
        for sign, changes in (("-", gone), ("+", new)):
            for change in changes.elements():
                lines.append(f"  {sign} hunk")
                lines += [f"    {ln}" for ln in change.splitlines()]
    for rel in sorted(set(sa.added) | set(sb.added)):
        if sa.added.get(rel) != sb.added.get(rel):
            lines.append(f"{rel}: the family file differs (a release hunk on it)")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = __doc__.strip().splitlines()[2].strip()
    if args in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(args) != 2:
        print(usage, file=sys.stderr)
        return 2
    try:
        lines = compare(*args)
    except DdtreeError as exc:  # like regenerate: one line, no traceback
        print(f"error: {exc}" + (f" ({exc.hint})" if exc.hint else ""), file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
