# SPDX-License-Identifier: Apache-2.0
"""tools.lint_series on the real series, and on broken copies of it."""

from __future__ import annotations

import re
from pathlib import Path

from stack_tooling import run_tool


def first_patch(patches: Path) -> Path:
    from tools._common import read_series

    return patches / read_series(patches / "series")[0]


def test_real_series_is_clean():
    proc = run_tool("lint_series")
    assert proc.returncode == 0, proc.stderr
    assert "all listed" in proc.stdout


def test_missing_file_is_rejected(patches_copy: Path):
    victim = first_patch(patches_copy)
    victim.unlink()
    proc = run_tool("lint_series", "--patches", str(patches_copy))
    assert proc.returncode == 1
    assert f"series lists {victim.name}, which does not exist" in proc.stderr


def test_unlisted_patch_is_rejected(patches_copy: Path):
    extra = patches_copy / "Bugfix-Stray.patch"
    extra.write_bytes(first_patch(patches_copy).read_bytes())
    proc = run_tool("lint_series", "--patches", str(patches_copy))
    assert proc.returncode == 1
    assert "Bugfix-Stray.patch is in" in proc.stderr and "not listed in the series" in proc.stderr


def test_unsigned_patch_is_rejected(patches_copy: Path):
    victim = first_patch(patches_copy)
    text = victim.read_text()
    assert "\nSigned-off-by: " in text
    victim.write_text(re.sub(r"(?m)^Signed-off-by: .*\n", "", text))
    proc = run_tool("lint_series", "--patches", str(patches_copy))
    assert proc.returncode == 1
    assert "no DCO `Signed-off-by" in proc.stderr


def test_missing_upstream_status_is_rejected(patches_copy: Path):
    victim = first_patch(patches_copy)
    victim.write_text(re.sub(r"(?m)^Upstream-Status: .*\n", "", victim.read_text()))
    proc = run_tool("lint_series", "--patches", str(patches_copy))
    assert proc.returncode == 1
    assert "no `Upstream-Status:` trailer" in proc.stderr


def test_subject_not_in_vllm_style_is_rejected(patches_copy: Path):
    victim = first_patch(patches_copy)
    victim.write_text(re.sub(r"(?m)^Subject: \[[^\]]+\] ", "Subject: ", victim.read_text(), count=1))
    proc = run_tool("lint_series", "--patches", str(patches_copy))
    assert proc.returncode == 1
    assert "not in vLLM's style" in proc.stderr


def test_headerless_diff_is_rejected(patches_copy: Path):
    victim = first_patch(patches_copy)
    text = victim.read_text()
    victim.write_text(text[text.index("diff --git "):])
    proc = run_tool("lint_series", "--patches", str(patches_copy))
    assert proc.returncode == 1
    assert "not a git mail" in proc.stderr
