"""Unpack the verified upstream sdist.

    python -m tools.source [--dest DIR] [--full] [--offline]

By default it writes the pinned ``vllm/`` package to ``vllm/`` at the repo
root, where ``QUILTRC=.quiltrc quilt push -a`` applies the series. An existing
destination is never overwritten or deleted: it may hold your work.
``--full`` unpacks the whole upstream tree (csrc/, tests/, setup.py, ...), the
stand-in for upstream's git tag.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from tools._common import REPO_ROOT, StackError, load_pin, parser, run_main, say
from tools.fetch import ensure

TOOL = "source"


def unpack(sdist: Path, dest: Path, *, full: bool) -> int:
    """Extract the sdist's tree (or its ``vllm/`` package) into the new
    ``dest`` through a temporary sibling, so that an interrupted run never
    leaves half of it; return the number of files."""
    if dest.exists():
        raise StackError(f"{dest} already exists; not overwriting it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with tarfile.open(sdist) as tar:
            members = tar.getmembers()
            prefix = members[0].name.split("/", 1)[0] + ("/" if full else "/vllm/")
            picked = [m for m in members if m.name.startswith(prefix) and m.name != prefix
                      and (m.isfile() or m.isdir())]
            for m in picked:
                m.name = m.name[len(prefix):]
            tar.extractall(tmp, members=picked, filter="data")
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return sum(1 for m in picked if m.isfile())


def unpack_sdist(dest: Path, *, offline: bool, full: bool = True) -> int:
    return unpack(ensure(load_pin().artifact("sdist"), offline=offline), dest, full=full)


def main() -> int:
    ap = parser("source", __doc__, offline=True)
    ap.add_argument("--dest", type=Path, default=REPO_ROOT / "vllm",
                    help="destination (default: vllm/ at the repo root)")
    ap.add_argument("--full", action="store_true", help="the whole upstream tree, not only vllm/")
    args = ap.parse_args()
    if args.dest.exists():
        say(TOOL, f"{args.dest} exists; left as it is (remove it yourself for a fresh copy)")
        return 0
    n = unpack_sdist(args.dest, offline=args.offline, full=args.full)
    say(TOOL, f"unpacked {n} files of {load_pin().artifact('sdist').filename} into {args.dest}")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
