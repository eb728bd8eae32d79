# SPDX-License-Identifier: Apache-2.0
"""tools/testenv.py: what it refuses before pip starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def test_too_little_disk_is_named_before_pip_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import tools.testenv as testenv
    from tools._common import StackError

    usage = type(shutil.disk_usage(tmp_path))
    seen: list[Path] = []

    def small_disk(path):
        seen.append(Path(path))
        return usage(100 * 10**9, 99 * 10**9, 10**9)

    monkeypatch.setattr(testenv.shutil, "disk_usage", small_disk)
    with pytest.raises(StackError, match=r"needs about 9 GB of free disk and 1\.0 GB is left.*pip cache purge"):
        testenv._check_disk(tmp_path / "venvs" / "cpu", 9)
    # The venv does not exist yet: the nearest existing parent is measured.
    assert seen == [tmp_path]


def test_enough_disk_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import tools.testenv as testenv

    usage = type(shutil.disk_usage(tmp_path))
    monkeypatch.setattr(testenv.shutil, "disk_usage", lambda p: usage(100 * 10**9, 50 * 10**9, 50 * 10**9))
    testenv._check_disk(tmp_path / "cpu", 9)
