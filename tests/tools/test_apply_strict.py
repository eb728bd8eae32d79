# SPDX-License-Identifier: Apache-2.0
"""The series applies strictly (tools.apply, git apply): a patch that would
need an offset or fuzz stops the run, naming the patch, and the build writes
no wheel."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from stack_tooling import run_tool
from tools._common import PATCHES_DIR, read_series

FIRST = read_series()[0]


@pytest.fixture
def tree(pristine_tree: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine_tree, tmp_path / "tree"))


def test_series_applies_exactly(tree: Path):
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert "no fuzz, no offset" in proc.stdout


@pytest.mark.parametrize("drift, says", [
    # Two extra lines at the top shift every hunk: git apply (and GNU patch)
    # would apply it at an offset; the stack must not.
    (lambda lines, start: ["# shifted\n"] * 2 + lines, "offset 2 lines"),
    # A changed context line of hunk #1: `patch --fuzz=2` would accept it.
    (lambda lines, start: lines[:start - 1] + [lines[start - 1].rstrip("\n") + "  # drifted\n"]
     + lines[start:], "patch does not apply"),
], ids=["offset", "fuzz"])
def test_offset_and_fuzz_are_refused(tree: Path, drift, says: str):
    text = (PATCHES_DIR / FIRST).read_text()
    target = tree / re.search(r"(?m)^--- a/(\S+)", text).group(1)
    start = int(re.search(r"(?m)^@@ -(\d+)", text).group(1))
    drifted = "".join(drift(target.read_text().splitlines(keepends=True), start))
    target.write_text(drifted)
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1
    assert f"{FIRST} does not apply exactly" in proc.stderr and says in proc.stderr
    assert target.read_text() == drifted


def test_build_stops_on_a_patch_that_needs_fuzz(patches_copy: Path, tmp_path: Path):
    """The same refusal through ./build.sh's wheel step, and no wheel appears."""
    patch = patches_copy / FIRST
    text = patch.read_text()
    # The first context line of hunk #1 no longer matches the sdist.
    m = re.search(r"(?m)^@@ .*\n (.*)$", text)
    patch.write_text(text[: m.start(1)] + m.group(1) + "  # drifted" + text[m.end(1):])
    dist = tmp_path / "dist"
    proc = run_tool("build_wheel", "--series", str(patches_copy / "series"), "--dist", str(dist))
    assert proc.returncode == 1
    assert f"{FIRST} does not apply exactly" in proc.stderr
    assert not dist.exists() or not any(dist.iterdir())
