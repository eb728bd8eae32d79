"""The drafter tools from a clone: ``python -m tools.eagle3_layers
show|check|convert|calibrate|doctor ...`` is the installed ``vllm-eagle3``
command (tools/vllm_eagle3, built into its own wheel by ./build.sh); run
``--help`` for each subcommand."""

from __future__ import annotations

import sys

from tools._common import REPO_ROOT
from tools.vllm_eagle3._base import drop_source_trees_from_path
from tools.vllm_eagle3.cli import main as _main
from tools.vllm_eagle3.cli import run
from tools.vllm_eagle3.layers import convert, show

__all__ = ["convert", "main", "show"]
PROG = "python -m tools.eagle3_layers"


def main(argv: list[str] | None = None) -> int:
    return _main(argv, PROG)


if __name__ == "__main__":
    # `python -m` put the repo root first on sys.path: its vllm/ is the
    # unpatched upstream source, never what serves.
    drop_source_trees_from_path(REPO_ROOT)
    sys.exit(run(prog=PROG))
