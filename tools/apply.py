"""Apply the series onto a source tree strictly: no fuzz, no offset.

    python -m tools.apply TREE [--series patches/series] [--check]

TREE is the upstream repository root (the directory that holds ``vllm/``).
Every hunk must match at exactly the line its header names, with every context
line identical; the first patch that does not stops the run with the patch
and hunk named, and TREE is left untouched (all patches are applied in memory
first, files are written only when the whole series applied).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools._common import SERIES_FILE, StackError, read_series, run_main, say

TOOL = "apply"
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def split_lines(text: str) -> list[str]:
    """Split on newline only: str.splitlines() would also split on form
    feeds and other separators that appear inside source files."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


@dataclass
class Hunk:
    header: str
    old_start: int
    old_lines: list[str] = field(default_factory=list)
    new_lines: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    old_path: str | None  # None: the patch creates the file
    new_path: str | None  # None: the patch deletes the file
    hunks: list[Hunk] = field(default_factory=list)


def _strip_prefix(path: str) -> str | None:
    if path == "/dev/null":
        return None
    path = path.split("\t", 1)[0]
    if not (path.startswith("a/") or path.startswith("b/")):
        raise StackError(f"path {path!r} lacks the a/ or b/ prefix of a -p1 patch")
    return path[2:]


def parse(text: str, name: str) -> list[FilePatch]:
    """Parse the unified diffs of a git mail (or a plain -p1 diff)."""
    lines = split_lines(text)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            fp = FilePatch(_strip_prefix(lines[i][4:].rstrip("\n")),
                           _strip_prefix(lines[i + 1][4:].rstrip("\n")))
            files.append(fp)
            i += 2
            while i < len(lines) and (m := HUNK_RE.match(lines[i])):
                hunk = Hunk(lines[i].rstrip("\n"), int(m.group(1)))
                old_n = int(m.group(2) or 1)
                new_n = int(m.group(4) or 1)
                i += 1
                while (old_n > 0 or new_n > 0) and i < len(lines):
                    line = lines[i]
                    tag, body = line[:1], line[1:]
                    if tag == " ":
                        hunk.old_lines.append(body)
                        hunk.new_lines.append(body)
                        old_n -= 1
                        new_n -= 1
                    elif tag == "-":
                        hunk.old_lines.append(body)
                        old_n -= 1
                    elif tag == "+":
                        hunk.new_lines.append(body)
                        new_n -= 1
                    elif line.startswith("\\"):
                        pass
                    else:
                        raise StackError(f"{name}: malformed hunk {hunk.header!r}")
                    i += 1
                    # "\ No newline at end of file" belongs to the line before.
                    if i < len(lines) and lines[i].startswith("\\ "):
                        target = hunk.new_lines if tag == "+" else hunk.old_lines
                        if tag == " ":
                            hunk.old_lines[-1] = hunk.old_lines[-1].rstrip("\n")
                            hunk.new_lines[-1] = hunk.new_lines[-1].rstrip("\n")
                        elif target:
                            target[-1] = target[-1].rstrip("\n")
                        i += 1
                if old_n or new_n:
                    raise StackError(f"{name}: hunk {hunk.header!r} is truncated")
                fp.hunks.append(hunk)
            continue
        i += 1
    if not files and "diff --git" in text:
        # Pure mode/rename changes carry no hunks; this stack has no use for them.
        raise StackError(f"{name}: has a diff without hunks (mode or rename only)")
    return files


def apply_file(content: list[str], fp: FilePatch, name: str, path: str) -> list[str]:
    out: list[str] = []
    pos = 0  # index into content of the next line not yet copied
    for n, hunk in enumerate(fp.hunks, 1):
        # For a pure insertion the header names the line *after which* to insert.
        start = hunk.old_start - 1 if hunk.old_lines else hunk.old_start
        where = f"{name}: {path}: hunk #{n} {hunk.header}"
        if start < pos:
            raise StackError(f"{where} overlaps the hunk before it")
        actual = content[start:start + len(hunk.old_lines)]
        if actual != hunk.old_lines:
            first_bad = next(
                (k for k, (a, b) in enumerate(zip(actual, hunk.old_lines)) if a != b),
                min(len(actual), len(hunk.old_lines)),
            )
            found_elsewhere = _find(content, hunk.old_lines)
            hint = (
                f"; its lines are at line {found_elsewhere + 1} instead (an offset "
                f"of {found_elsewhere - start:+d}): refresh the patch"
                if found_elsewhere is not None
                else "; the context differs (it would need fuzz): refresh the patch"
            )
            expected = hunk.old_lines[first_bad] if first_bad < len(hunk.old_lines) else "<end of file>"
            got = actual[first_bad] if first_bad < len(actual) else "<end of file>"
            raise StackError(
                f"{where} does not apply exactly at line {start + 1 + first_bad}: "
                f"expected {expected.rstrip()!r}, found {got.rstrip()!r}{hint}"
            )
        out.extend(content[pos:start])
        out.extend(hunk.new_lines)
        pos = start + len(hunk.old_lines)
    out.extend(content[pos:])
    return out


def _find(content: list[str], needle: list[str]) -> int | None:
    if not needle:
        return None
    for k in range(len(content) - len(needle) + 1):
        if content[k:k + len(needle)] == needle:
            return k
    return None


def apply_patch(current, text: str, name: str) -> dict[str, list[str] | None]:
    """Apply one patch in memory. ``current(path)`` gives a file's lines (None:
    absent). Returns the new lines of every path it touches (None: deleted),
    or raises StackError naming the patch and hunk; nothing is changed."""
    changes: dict[str, list[str] | None] = {}

    def now(path: str) -> list[str] | None:
        return changes[path] if path in changes else current(path)

    for fp in parse(text, name):
        path = fp.new_path or fp.old_path
        assert path is not None
        old = now(fp.old_path) if fp.old_path else None
        if fp.old_path is None and now(path) is not None:
            raise StackError(f"{name}: creates {path}, which already exists")
        if fp.old_path is not None and old is None:
            raise StackError(f"{name}: patches {fp.old_path}, which the tree lacks")
        new = apply_file(old or [], fp, name, path)
        if fp.old_path and fp.new_path and fp.old_path != fp.new_path:
            changes[fp.old_path] = None
        changes[path] = None if fp.new_path is None else new
    return changes


def tree_reader(tree: Path, state: dict[str, list[str] | None]):
    """``current(path)`` for apply_patch: ``state`` first, then ``tree``."""
    def current(path: str) -> list[str] | None:
        if path not in state:
            f = tree / path
            state[path] = split_lines(f.read_bytes().decode("utf-8")) if f.exists() else None
        return state[path]
    return current


def write_state(tree: Path, state: dict[str, list[str] | None]) -> None:
    for path, lines in state.items():
        f = tree / path
        if lines is None:
            if f.exists():
                f.unlink()
        else:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes("".join(lines).encode("utf-8"))


def apply_series(tree: Path, series: Path, *, check: bool = False) -> list[str]:
    """Apply every patch of ``series`` onto ``tree``; return the touched paths.
    Nothing is written unless the whole series applies."""
    state: dict[str, list[str] | None] = {}  # path -> lines (None: deleted)
    current = tree_reader(tree, state)
    names = read_series(series)
    for name in names:
        patch = series.parent / name
        if not patch.exists():
            raise StackError(f"{series} names {name}, which does not exist")
        text = patch.read_bytes().decode("utf-8")
        state.update(apply_patch(current, text, name))
        files = parse(text, name)
        say(TOOL, f"{'checked' if check else 'applied'} {name} ({len(files)} file(s), "
            f"{sum(len(f.hunks) for f in files)} hunk(s), no fuzz, no offset)")
    if not check:
        write_state(tree, state)
    return sorted(state)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.apply", description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", type=Path, help="upstream root: the directory holding vllm/")
    ap.add_argument("--series", type=Path, default=SERIES_FILE)
    ap.add_argument("--check", action="store_true", help="verify only; write nothing")
    args = ap.parse_args()
    touched = apply_series(args.tree, args.series, check=args.check)
    say(TOOL, f"{len(read_series(args.series))} patch(es) onto {args.tree}; files: "
        + (", ".join(touched) or "none"))
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
