# SPDX-License-Identifier: Apache-2.0
"""The series applies strictly (tools.apply, git apply): a patch that would
need an offset or fuzz stops the run, naming the patch, and the build writes
no wheel."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT, run_tool


def _first_target() -> tuple[str, str, int]:
    """(patch, first file it modifies, first hunk's old start line)."""
    from tools._common import read_series

    name = read_series(REPO_ROOT / "patches" / "series")[0]
    text = (REPO_ROOT / "patches" / name).read_text()
    path = re.search(r"(?m)^--- a/(\S+)", text).group(1)
    start = int(re.search(r"(?m)^@@ -(\d+)", text).group(1))
    return name, path, start


@pytest.fixture
def tree(pristine_tree: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "tree"
    shutil.copytree(pristine_tree, dest)
    return dest


def test_series_applies_exactly(tree: Path):
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert "no fuzz, no offset" in proc.stdout


def test_offset_is_refused(tree: Path):
    name, path, _ = _first_target()
    target = tree / path
    before = target.read_text()
    # Two extra lines at the top shift every hunk: git apply (and GNU patch)
    # would apply it at an offset; the stack must not.
    target.write_text("# shifted\n# shifted\n" + before)
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1
    assert f"{name} does not apply exactly" in proc.stderr
    assert "offset 2 lines" in proc.stderr
    assert target.read_text() == "# shifted\n# shifted\n" + before


def test_fuzz_is_refused(tree: Path):
    name, path, start = _first_target()
    target = tree / path
    lines = target.read_text().splitlines(keepends=True)
    # A changed context line of hunk #1: `patch --fuzz=2` would accept it.
    lines[start - 1] = lines[start - 1].rstrip("\n") + "  # drifted\n"
    target.write_text("".join(lines))
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1
    assert f"{name} does not apply exactly" in proc.stderr
    assert "patch does not apply" in proc.stderr


def test_build_stops_on_a_patch_that_needs_fuzz(patches_copy: Path, tmp_path: Path):
    """The same refusal through ./build.sh's wheel step, and no wheel appears."""
    from tools._common import read_series

    name = read_series(patches_copy / "series")[0]
    patch = patches_copy / name
    text = patch.read_text()
    # The first context line of hunk #1 no longer matches the sdist.
    m = re.search(r"(?m)^@@ .*\n (.*)$", text)
    text = text[: m.start(1)] + m.group(1) + "  # drifted" + text[m.end(1):]
    patch.write_text(text)
    dist = tmp_path / "dist"
    proc = run_tool("build_wheel", "--series", str(patches_copy / "series"),
                    "--dist", str(dist))
    assert proc.returncode == 1
    assert f"{name} does not apply exactly" in proc.stderr
    assert not dist.exists() or not any(dist.iterdir())
