# SPDX-License-Identifier: Apache-2.0
"""The build applies the series strictly: a patch that would need an offset
or fuzz stops the build, naming the patch and the hunk, and writes nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT, run_tool


def _series_target(patches: Path) -> tuple[str, str]:
    """(patch name, first path it modifies) of the series' first patch."""
    from tools._common import read_series
    from tools.apply import parse

    name = read_series(patches / "series")[0]
    fp = parse((patches / name).read_text(), name)[0]
    assert fp.old_path
    return name, fp.old_path


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
    name, path = _series_target(REPO_ROOT / "patches")
    target = tree / path
    before = target.read_text()
    # Two extra lines at the top shift every hunk: GNU patch would apply it
    # "with offset 2"; the build must not.
    target.write_text("# shifted\n# shifted\n" + before)
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1
    assert f"{name}: {path}: hunk #1" in proc.stderr
    assert "an offset of +2" in proc.stderr
    assert target.read_text() == "# shifted\n# shifted\n" + before  # nothing written


def test_fuzz_is_refused(tree: Path):
    from tools.apply import parse

    name, path = _series_target(REPO_ROOT / "patches")
    hunk = parse((REPO_ROOT / "patches" / name).read_text(), name)[0].hunks[0]
    target = tree / path
    lines = target.read_text().splitlines(keepends=True)
    # Change the first context line of hunk #1: `patch --fuzz=2` would accept.
    idx = hunk.old_start - 1
    lines[idx] = lines[idx].rstrip("\n") + "  # drifted\n"
    target.write_text("".join(lines))
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1
    assert f"{name}: {path}: hunk #1" in proc.stderr
    assert "would need fuzz" in proc.stderr


def test_later_failure_writes_nothing(tree: Path, patches_copy: Path):
    """The whole series applies in memory before any file is written."""
    from tools._common import read_series

    names = read_series(patches_copy / "series")
    bad = patches_copy / "Bugfix-Does-not-apply.patch"
    bad.write_text(
        "diff --git a/vllm/no_such_file.py b/vllm/no_such_file.py\n"
        "--- a/vllm/no_such_file.py\n+++ b/vllm/no_such_file.py\n"
        "@@ -1 +1 @@\n-a\n+b\n"
    )
    (patches_copy / "series").write_text("\n".join([*names, bad.name]) + "\n")
    snapshot = {p: p.read_bytes() for p in tree.rglob("*.py")}
    proc = run_tool("apply", str(tree), "--series", str(patches_copy / "series"))
    assert proc.returncode == 1
    assert "Bugfix-Does-not-apply.patch: patches vllm/no_such_file.py" in proc.stderr
    assert all(p.read_bytes() == b for p, b in snapshot.items())


def test_build_stops_on_a_patch_needing_offset(patches_copy: Path, tmp_path: Path):
    """The same refusal through ./build.sh's wheel step, and no wheel appears."""
    from tools._common import read_series

    name = read_series(patches_copy / "series")[0]
    patch = patches_copy / name
    text = patch.read_text()
    # Move the first hunk's claimed position by 3 lines: an offset patch.
    import re

    m = re.search(r"(?m)^@@ -(\d+)", text)
    assert m
    text = text[: m.start(1)] + str(int(m.group(1)) + 3) + text[m.end(1):]
    patch.write_text(text)
    dist = tmp_path / "dist"
    proc = run_tool("build_wheel", "--series", str(patches_copy / "series"),
                    "--dist", str(dist))
    assert proc.returncode == 1
    assert f"{name}:" in proc.stderr and "hunk #1" in proc.stderr
    assert not dist.exists() or not any(dist.iterdir())
