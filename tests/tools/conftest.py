# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the stack's own tooling (tools/): real inputs, temp copies."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Appended, not prepended: the installed vllm (already imported by the root
# conftest) must keep precedence over the repo-root vllm/ tree.
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))


def run_tool(module: str, *args: str, env: dict[str, str] | None = None,
             cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """Run a tool the way a user does: ``python -m tools.X`` from the repo."""
    import os

    return subprocess.run(
        [sys.executable, "-m", f"tools.{module}", *args],
        cwd=cwd, capture_output=True, text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def patches_copy(tmp_path: Path) -> Path:
    """A writable copy of patches/ (series and every patch)."""
    dest = tmp_path / "patches"
    shutil.copytree(REPO_ROOT / "patches", dest)
    return dest


@pytest.fixture(scope="session")
def pristine_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned sdist's vllm/ package, unpacked from the verified cache."""
    from tools._common import load_pin
    from tools.fetch import ensure
    from tools.source import unpack

    root = tmp_path_factory.mktemp("pristine") / "tree"
    unpack(ensure(load_pin().artifact("sdist"), offline=False), root / "vllm", full=False)
    return root
