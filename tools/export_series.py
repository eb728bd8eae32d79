"""Export the commits on top of ``stack-base`` back into patches/.

    python -m tools.export_series DIR [--check]

Runs ``git format-patch`` with fixed options (no stat, no signature, zero
commit hash, full index, myers diff, a/ b/ prefixes, 3 lines of context,
whatever the user's git config says), names each file after its subject as
format-patch does but without the ``NNNN-`` number (the series file is the
only order), and rewrites patches/series keeping its leading comments.
Re-exporting an unchanged import reproduces every patch byte for byte;
``--check`` proves that without writing anything.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools._common import PATCHES_DIR, StackError, run_main, say
from tools.import_series import BASE_TAG, git

TOOL = "export"
# tools.import_series.git() hides the user's and the system's git config, so
# only the repository's own config could still change the output; pin what it
# might set.
FORMAT_PATCH = [
    "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
    "-c", "format.numbered=false", "-c", "format.coverLetter=false",
    "-c", "format.suffix=.patch",
    "format-patch", "--no-to", "--no-cc", "--no-thread", "--keep-subject", "--no-stat", "--no-signature", "--zero-commit",
    "--full-index", "--find-renames", "--diff-algorithm=myers", "--no-color", "-U3",
    "--src-prefix=a/", "--dst-prefix=b/", "--no-notes", "--no-base",
]


def export(repo: Path) -> dict[str, bytes]:
    """Return {file name: bytes} for the commits in stack-base..HEAD, in order."""
    if git(repo, "rev-parse", "-q", "--verify", f"refs/tags/{BASE_TAG}",
           check=False).returncode != 0:
        raise StackError(f"{repo} has no tag {BASE_TAG}: make it with tools.import_series")
    with tempfile.TemporaryDirectory() as tmp:
        out = git(repo, *FORMAT_PATCH, "-o", tmp, f"{BASE_TAG}..HEAD").stdout.split()
        result: dict[str, bytes] = {}
        for f in out:
            name = re.sub(r"^\d{4}-", "", Path(f).name)
            if name in result:
                raise StackError(f"two commits would both export as {name}: "
                                 "give them distinct subjects")
            result[name] = Path(f).read_bytes()
    return result


def series_text(old: Path, names: list[str]) -> str:
    header: list[str] = []
    if old.exists():
        for line in old.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                break
            header.append(line)
    return "".join(f"{h}\n" for h in header) + "".join(f"{n}\n" for n in names)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.export_series",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="repository made by tools.import_series")
    ap.add_argument("--patches", type=Path, default=PATCHES_DIR)
    ap.add_argument("--check", action="store_true",
                    help="write nothing; fail unless patches/ already matches")
    args = ap.parse_args()
    patches = export(args.dir)
    series = args.patches / "series"
    new_series = series_text(series, list(patches)).encode()
    existing = {p.name: p.read_bytes() for p in args.patches.glob("*.patch")}
    changed = [n for n, b in patches.items() if existing.get(n) != b]
    removed = [n for n in existing if n not in patches]
    series_changed = not series.exists() or series.read_bytes() != new_series
    if args.check:
        for n in changed:
            say(TOOL, f"differs: {n}" if n in existing else f"missing: {n}")
        for n in removed:
            say(TOOL, f"not produced by the export: {n}")
        if series_changed:
            say(TOOL, "differs: series")
        if changed or removed or series_changed:
            say(TOOL, "round trip NOT byte-identical")
            return 1
        say(TOOL, f"round trip byte-identical: {len(patches)} patch(es) and series")
        return 0
    args.patches.mkdir(parents=True, exist_ok=True)
    for n in changed:
        (args.patches / n).write_bytes(patches[n])
        say(TOOL, f"{'updated' if n in existing else 'added'} {n}")
    for n in removed:
        (args.patches / n).unlink()
        say(TOOL, f"removed {n} (no longer a commit; it stays in git history)")
    if series_changed:
        series.write_bytes(new_series)
        say(TOOL, "rewrote series")
    say(TOOL, f"{len(patches)} patch(es) exported; {len(changed)} changed, "
        f"{len(removed)} removed")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
