"""Apply the series onto a source tree strictly: no fuzz, no offset.

    python -m tools.apply TREE [--series patches/series]

TREE is the upstream root (the directory that holds ``vllm/``). git apply
never fuzzes, and a hunk its verbose report says matched at an offset is
refused too. The stack's one applier: the build, leave-one-out, the upstream
test run and the GPU harness all call it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tools._common import SERIES_FILE, StackError, parser, run_main, say, series_patches

TOOL = "apply"


def _git_apply(tree: Path, patch: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A tree inside another repository (build/ is inside this one) would make
    # git resolve the patch's paths against that repository and skip them
    # silently; the ceiling keeps git from looking above the tree.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.resolve().parent)}
    return subprocess.run(["git", "apply", "-v", *args, str(patch.resolve())],
                          cwd=tree, env=env, capture_output=True, text=True)


def apply_patch(tree: Path, patch: Path) -> None:
    """Apply one patch onto ``tree`` (all or nothing), or raise StackError."""
    proc = _git_apply(tree, patch, "--check")
    report = proc.stdout + proc.stderr
    if proc.returncode or "offset" in report or "Skipped patch" in report:
        problems = [line for line in report.splitlines()
                    if "offset" in line or "error" in line or "Skipped" in line]
        raise StackError(f"{patch.name} does not apply exactly to {tree}: "
                         + "; ".join(problems or [report.strip()]))
    proc = _git_apply(tree, patch)
    if proc.returncode:
        raise StackError(f"{patch.name}: {proc.stderr.strip()}")


def touched_paths(patch: Path) -> list[str]:
    proc = subprocess.run(["git", "apply", "--numstat", "-z", str(patch)],
                          capture_output=True, text=True, check=True)
    return sorted({entry.split("\t")[-1] for entry in proc.stdout.split("\0") if entry})


def series_paths(series: Path) -> list[str]:
    return sorted({p for patch in series_patches(series) for p in touched_paths(patch)})


def apply_series(tree: Path, series: Path) -> list[str]:
    """Apply every patch; return the touched paths. A failure leaves the
    patches before it applied: callers work on a copy."""
    for patch in series_patches(series):
        apply_patch(tree, patch)
        say(TOOL, f"applied {patch.name} (no fuzz, no offset)")
    return series_paths(series)


def main() -> int:
    ap = parser("apply", __doc__)
    ap.add_argument("tree", type=Path, help="upstream root: the directory holding vllm/")
    ap.add_argument("--series", type=Path, default=SERIES_FILE)
    args = ap.parse_args()
    touched = apply_series(args.tree, args.series)
    say(TOOL, f"{len(series_patches(args.series))} patch(es) onto {args.tree}; files: "
        + (", ".join(touched) or "none"))
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
