# SPDX-License-Identifier: Apache-2.0
"""The series goes into git with `git am` onto the pinned sdist (the stand-in
for upstream's v0.16.0 tag) and comes back out byte for byte."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from stack_tooling import run_tool
from tools._common import read_series


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("gitq") / "upstream"
    proc = run_tool("import_series", str(repo))
    assert proc.returncode == 0, proc.stderr
    return repo


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",
                           "user.email=t@example.invalid", *args],
                          capture_output=True, text=True, check=True).stdout


def test_git_am_makes_one_commit_per_patch(imported: Path):
    subjects = git(imported, "log", "--reverse", "--format=%s", "stack-base..HEAD").splitlines()
    assert len(subjects) == len(read_series())
    # --keep-non-patch: vLLM's [Tag] prefixes survive the import.
    assert all(s.startswith("[") for s in subjects)


def test_export_round_trip_is_byte_identical(imported: Path):
    proc = run_tool("export_series", str(imported), "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "byte-identical" in proc.stdout


def test_export_check_notices_a_changed_commit(imported: Path, tmp_path: Path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(imported), str(clone)], check=True)
    git(clone, "fetch", "-q", "--tags", str(imported))
    git(clone, "commit", "-q", "--amend",
        "-m", "[Model] Reworded\n\nbody\n\nSigned-off-by: t <t@example.invalid>")
    proc = run_tool("export_series", str(clone), "--check")
    assert proc.returncode == 1
    assert "NOT byte-identical" in proc.stdout


def test_existing_directory_is_refused(tmp_path: Path):
    (tmp_path / "work.txt").write_text("precious")
    proc = run_tool("import_series", str(tmp_path))
    assert proc.returncode == 1
    assert "exists" in proc.stderr
    assert (tmp_path / "work.txt").read_text() == "precious"
