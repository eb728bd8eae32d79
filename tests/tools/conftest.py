# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the stack's own tooling (tools/): real inputs, temp copies."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

# Appended, not prepended: the installed vllm (already imported by the root
# conftest) must keep precedence over the repo-root vllm/ tree. The first
# entry makes `tools` importable, the second `stack_tooling`.
for _p in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

from stack_tooling import REPO_ROOT  # noqa: E402



@pytest.fixture
def patches_copy(tmp_path: Path) -> Path:
    """A writable copy of patches/ (series and every patch)."""
    dest = tmp_path / "patches"
    shutil.copytree(REPO_ROOT / "patches", dest)
    return dest


@pytest.fixture(scope="session")
def pristine_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned sdist's whole tree (vllm/ and tests/, which the series
    patches too), unpacked from the verified cache."""
    from tools._common import load_pin
    from tools.fetch import ensure
    from tools.source import unpack

    root = tmp_path_factory.mktemp("pristine") / "tree"
    unpack(ensure(load_pin().artifact("sdist"), offline=False), root, full=True)
    return root
