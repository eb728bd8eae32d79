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

from tools._common import PATCHES_DIR  # noqa: E402
from tools.source import unpack_sdist  # noqa: E402


@pytest.fixture
def patches_copy(tmp_path: Path) -> Path:
    """A writable copy of patches/ (series and every patch)."""
    return Path(shutil.copytree(PATCHES_DIR, tmp_path / "patches"))


@pytest.fixture(scope="session")
def pristine_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned sdist's whole tree (vllm/ and tests/, which the series
    patches too), unpacked from the verified cache."""
    root = tmp_path_factory.mktemp("pristine") / "tree"
    unpack_sdist(root, offline=False)
    return root
