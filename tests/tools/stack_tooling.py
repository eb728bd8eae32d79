# SPDX-License-Identifier: Apache-2.0
"""Helpers for the tooling tests (importable: tests/tools is on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_tool(module: str, *args: str, env: dict[str, str] | None = None,
             cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """Run a tool the way a user does: ``python -m tools.X`` from the repo."""
    return subprocess.run(
        [sys.executable, "-m", f"tools.{module}", *args],
        cwd=cwd, capture_output=True, text=True,
        env={**os.environ, **(env or {})},
    )
