"""A small unified-diff reader and applier (no git needed).

Patch series are stored as plain unified diffs so a reviewer can read them and ``git apply``
accepts them. Applying is done in memory on whole-file text: the caller decides what to
write and when (see :mod:`ddtree_cli.patching.engine`).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class DiffError(ValueError):
    """A diff that does not parse, or does not fit the text it is applied to."""


@dataclass
class Hunk:
    old_start: int  # 1-based; 0 for an empty old side
    new_start: int = 0
    lines: list[str] = field(default_factory=list)  # each keeps its ' ', '-' or '+' prefix

    @property
    def old_lines(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[0] in " -"]

    @property
    def new_lines(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[0] in " +"]


@dataclass
class FileDiff:
    path: str  # relative to the snapshot root, without a/ b/ prefixes
    hunks: list[Hunk]
    new_file: bool = False


def _strip_prefix(name: str) -> str:
    name = name.split("\t", 1)[0].strip()
    if name.startswith(("a/", "b/")):
        return name[2:]
    return name


def parse(text: str) -> list[FileDiff]:
    """Parse a unified diff of one or more files. Lines keep their trailing newline."""
    lines = text.splitlines(keepends=True)
    files: list[FileDiff] = []
    i = 0
    current: FileDiff | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old = _strip_prefix(line[4:])
            new = _strip_prefix(lines[i + 1][4:])
            current = FileDiff(path=new, hunks=[], new_file=old == "/dev/null")
            files.append(current)
            i += 2
            continue
        match = _HUNK_RE.match(line)
        if match:
            if current is None:
                raise DiffError(f"hunk before any file header at line {i + 1}")
            old_count = int(match.group(2) or 1)
            new_count = int(match.group(4) or 1)
            hunk = Hunk(old_start=int(match.group(1)), new_start=int(match.group(3)))
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_count or seen_new < new_count):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    if hunk.lines:
                        hunk.lines[-1] = hunk.lines[-1].rstrip("\n")
                    i += 1
                    continue
                tag = body[:1] if body not in ("\n", "") else " "
                if tag not in " +-":
                    raise DiffError(f"bad hunk line {i + 1}: {body[:40]!r}")
                content = body if body != "\n" else " \n"
                hunk.lines.append(content)
                seen_old += tag in " -"
                seen_new += tag in " +"
                i += 1
            if i < len(lines) and lines[i].startswith("\\") and hunk.lines:
                hunk.lines[-1] = hunk.lines[-1].rstrip("\n")
                i += 1
            if seen_old != old_count or seen_new != new_count:
                raise DiffError(f"truncated hunk ending at line {i}")
            current.hunks.append(hunk)
            continue
        i += 1
    return files


def _find(haystack: list[str], needle: list[str], start: int, lo: int) -> int | None:
    """Index of ``needle`` in ``haystack`` nearest to ``start``, not before ``lo``."""
    if not needle:
        return max(min(start, len(haystack)), lo)
    n = len(needle)
    best: int | None = None
    for pos in range(lo, len(haystack) - n + 1):
        if haystack[pos : pos + n] == needle and (
            best is None or abs(pos - start) < abs(best - start)
        ):
            best = pos
    return best


def apply(text: str, diff: FileDiff, *, fuzzy: bool = False) -> str:
    """Apply one file's hunks to ``text``.

    Strict mode requires every hunk at its recorded line. ``fuzzy`` (``--force``) looks the
    hunk's full context up anywhere after the previous hunk and fails if it is missing or
    not unique (even where it also sits at its recorded line); it never drops context.
    """
    src = text.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0
    for number, hunk in enumerate(diff.hunks, 1):
        old = hunk.old_lines
        want = max(hunk.old_start - 1, 0)
        if fuzzy:  # anywhere after the previous hunk, but only where it is unique
            pos = _find(src, old, want, cursor)
            if pos is None:
                raise DiffError(f"{diff.path}: anchor of hunk {number} not found")
            if old and _find(src[pos + 1 :], old, 0, 0) is not None:
                raise DiffError(f"{diff.path}: anchor of hunk {number} is ambiguous")
        elif src[want : want + len(old)] == old and want >= cursor:
            pos = want
        else:
            raise DiffError(f"{diff.path}: hunk {number} does not match at line {want + 1}")
        out.extend(src[cursor:pos])
        out.extend(hunk.new_lines)
        cursor = pos + len(old)
    out.extend(src[cursor:])
    return "".join(out)


def unmatched_hunks(text: str, diff: FileDiff) -> list[str]:
    """Why each hunk of ``diff`` would not apply to ``text`` by its context (``--force``):
    one line per hunk whose anchor is missing or not unique; empty when all would apply."""
    src = text.splitlines(keepends=True)
    problems: list[str] = []
    cursor = 0
    for number, hunk in enumerate(diff.hunks, 1):
        old = hunk.old_lines
        pos = _find(src, old, max(hunk.old_start - 1, 0), cursor)
        if pos is None:
            problems.append(f"{diff.path}: hunk {number} (anchor not found)")
            continue
        if old and _find(src[pos + 1 :], old, 0, 0) is not None:
            problems.append(f"{diff.path}: hunk {number} (anchor is ambiguous)")
        cursor = pos + len(old)
    return problems


def reverse(diff: FileDiff) -> FileDiff:
    """The diff that undoes ``diff`` (used to recognise an already-patched file)."""
    swap = {"+": "-", "-": "+", " ": " "}
    hunks = [
        Hunk(
            old_start=h.new_start,
            new_start=h.old_start,
            lines=[swap[ln[0]] + ln[1:] for ln in h.lines],
        )
        for h in diff.hunks
    ]
    return FileDiff(path=diff.path, hunks=hunks, new_file=False)


def make(path: str, old: str | None, new: str) -> str:
    """A git-style unified diff of one file (``old=None`` for a new file)."""
    old_lines = [] if old is None else old.splitlines(keepends=True)
    new_lines = new.splitlines(keepends=True)
    header = [f"diff --git a/{path} b/{path}\n"]
    if old is None:
        header.append("new file mode 100644\n")
    body = list(
        difflib.unified_diff(
            old_lines,
            new_lines,
            fromfile="/dev/null" if old is None else f"a/{path}",
            tofile=f"b/{path}",
            n=3,
        )
    )
    fixed: list[str] = []
    for line in body:
        if not line.endswith("\n"):
            fixed.append(line + "\n\\ No newline at end of file\n")
        else:
            fixed.append(line)
    return "".join(header + fixed)
