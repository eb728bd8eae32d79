"""Unpack the verified upstream sdist.

    python -m tools.source [--dest DIR] [--full] [--offline]

By default it writes the pinned ``vllm/`` package to ``vllm/`` at the repo
root, where ``QUILTRC=.quiltrc quilt push -a`` applies the series. An existing
destination is never overwritten or deleted: it may hold your work.
``--full`` unpacks the whole upstream tree (csrc/, tests/, setup.py, ...), the
stand-in for upstream's git tag.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from tools._common import REPO_ROOT, StackError, load_pin, run_main, say
from tools.fetch import ensure, offline_default

TOOL = "source"


def unpack(sdist: Path, dest: Path, *, full: bool) -> int:
    """Extract the sdist's tree (or just its ``vllm/`` package) into ``dest``,
    which must not exist. Extraction goes to a temporary sibling first, so an
    interrupted run never leaves a half-written ``dest``."""
    if dest.exists():
        raise StackError(f"{dest} already exists; not overwriting it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    count = 0
    try:
        with tarfile.open(sdist) as tar:
            members = tar.getmembers()
            top = members[0].name.split("/", 1)[0]
            prefix = f"{top}/" if full else f"{top}/vllm/"
            picked = []
            for m in members:
                if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                    continue
                m.name = m.name[len(prefix):]
                if m.name:
                    picked.append(m)
            tar.extractall(tmp, members=picked, filter="data")
            count = sum(1 for m in picked if m.isfile())
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return count


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.source", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=None,
                    help="destination (default: vllm/ at the repo root)")
    ap.add_argument("--full", action="store_true", help="the whole upstream tree, not only vllm/")
    ap.add_argument("--offline", action="store_true", default=offline_default())
    args = ap.parse_args()
    dest = args.dest or REPO_ROOT / "vllm"
    if dest.exists():
        say(TOOL, f"{dest} exists; left as it is (remove it yourself for a fresh copy)")
        return 0
    sdist = ensure(load_pin().artifact("sdist"), offline=args.offline)
    n = unpack(sdist, dest, full=args.full)
    say(TOOL, f"unpacked {n} files of {sdist.name} into {dest}")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
