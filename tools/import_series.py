"""Import the series into a git repository of the pinned upstream tree.

    python -m tools.import_series DIR [--offline]

DIR (new) becomes a git repository whose first commit is the verified sdist's
whole tree, the stand-in for upstream's v0.16.0 tag (tagged ``stack-base``),
followed by one commit per patch made by ``git am --keep-non-patch``, so
``[Tag]`` subjects survive. That is also the proof that the series applies
with ``git am`` onto upstream. Edit, rebase or add commits there, then write
them back with ``python -m tools.export_series DIR``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tools._common import SERIES_FILE, StackError, load_pin, parser, run_main, say, series_patches
from tools.source import unpack_sdist

TOOL = "import"
BASE_TAG = "stack-base"
# Owner and date of the base commit: fixed, so that an import is reproducible.
TOOL_IDENT = ("vLLM EAGLE-3 Stack", "eagle3-stack@users.noreply.github.com")
BASE_DATE = "2026-01-01T00:00:00+00:00"


def git(repo: Path, *args: str, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    # Neither the user's nor the system's git config may change what an
    # import or export writes: the round trip must be byte-identical anywhere.
    full_env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull,
                "GIT_CONFIG_NOSYSTEM": "1", **(env or {})}
    cmd = ["git", "-C", str(repo), "-c", f"user.name={TOOL_IDENT[0]}",
           "-c", f"user.email={TOOL_IDENT[1]}", "-c", "commit.gpgsign=false",
           "-c", "core.autocrlf=false", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env)
    if check and proc.returncode != 0:
        raise StackError(f"`git {' '.join(args)}` failed in {repo}:\n"
                         f"{proc.stdout}{proc.stderr}".rstrip())
    return proc


def make_base(repo: Path, *, offline: bool) -> None:
    pin = load_pin()
    sdist = pin.artifact("sdist")
    n = unpack_sdist(repo, offline=offline)
    git(repo, "init", "-q", "-b", "main")
    # -f: upstream's .gitignore ignores generated files the sdist ships
    # (vllm/_version.py); the base must be the sdist exactly.
    git(repo, "add", "-A", "-f")
    git(repo, "commit", "-q", "-m", f"{pin.project} {pin.tag} (sdist {sdist.filename}, "
        f"sha256 {sdist.sha256})",
        env={"GIT_AUTHOR_DATE": BASE_DATE, "GIT_COMMITTER_DATE": BASE_DATE})
    git(repo, "tag", BASE_TAG)
    say(TOOL, f"{repo}: base commit of {n} files from {sdist.filename}, tagged {BASE_TAG}")


def am_series(repo: Path, series: Path) -> int:
    patches = series_patches(series)
    for patch in patches:
        proc = git(repo, "am", "--keep-non-patch", "--committer-date-is-author-date",
                   "--whitespace=nowarn", str(patch.resolve()), check=False)
        if proc.returncode != 0:
            raise StackError(
                f"git am stopped at {patch.name}:\n{(proc.stdout + proc.stderr).strip()}\n"
                f"{repo} is left mid-am: fix and `git am --continue` there, or `git am --abort`.")
        say(TOOL, f"git am {patch.name}")
    return len(patches)


def main() -> int:
    ap = parser("import_series", __doc__, offline=True)
    ap.add_argument("dir", type=Path, help="new directory for the git repository")
    ap.add_argument("--series", type=Path, default=SERIES_FILE)
    args = ap.parse_args()
    if args.dir.exists():
        raise StackError(f"{args.dir} exists; choose a new directory (nothing was changed)")
    make_base(args.dir, offline=args.offline)
    n = am_series(args.dir, args.series)
    say(TOOL, f"{n} patch(es) applied with git am onto {BASE_TAG} in {args.dir}")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
