# SPDX-License-Identifier: Apache-2.0
"""tools.lint_series on the committed series, and on small synthetic series with
one rule broken at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from stack_tooling import run_tool, write_mail

AUTHOR = "Ada Lovelace <ada@example.org>"
PR = "https://github.com/vllm-project/vllm/pull/36361"
COMMIT = "https://github.com/vllm-project/vllm/commit/0123abc"


def series_of(tmp_path: Path, **mail) -> Path:
    """A one-patch series whose mail is write_mail(**mail)."""
    patches = tmp_path / "patches"
    patches.mkdir()
    mail.setdefault("trailers", [f"Upstream-Status: Submitted [{PR}]",
                                 f"Signed-off-by: {AUTHOR}"])
    mail.setdefault("author", AUTHOR)
    (patches / "Model-Foo.patch").write_text(write_mail(**mail))
    (patches / "series").write_text("# a comment\nModel-Foo.patch\n")
    return patches


def lint(patches: Path):
    return run_tool("lint_series", "--patches", str(patches))


def test_committed_series_is_clean():
    proc = run_tool("lint_series")
    assert proc.returncode == 0, proc.stderr
    assert "all listed" in proc.stdout


def test_a_well_formed_mail_passes(tmp_path: Path):
    proc = lint(series_of(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "1 patch(es)" in proc.stdout


@pytest.mark.parametrize("status", [
    "Pending",
    f"Submitted [{PR}]",
    "Accepted",
    f"Backport [{COMMIT}]",
    f"Backport [{PR}, https://github.com/vllm-project/vllm/pull/37232]",
    "Denied",
    "Inappropriate [needed by this stack's CPU test build only]",
    "Inactive-Upstream",
    "Inactive-Upstream [lastrelease: 2019]",
])
def test_yocto_vocabulary_is_accepted(tmp_path: Path, status: str):
    proc = lint(series_of(tmp_path, trailers=[f"Upstream-Status: {status}",
                                              f"Signed-off-by: {AUTHOR}"]))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("status, says", [
    ("equivalent v0.18.0", "not in Yocto's vocabulary"),
    ("pending", "not in Yocto's vocabulary"),
    ("Submitted", "cites no checkable reference"),
    ("Submitted []", "the bracket is empty"),
    ("Backport [v0.18.0]", "cites no checkable reference: write `Backport [https://github.com/"
                           "vllm-project/vllm/pull/<N>]`"),
    ("Backport [https://github.com/vllm-project/vllm/issues/1]", "is neither"),
    ("Backport [https://github.com/other/vllm/pull/1]", "is neither"),
    ("Backport [https://github.com/vllm-project/vllm/commit/12ab]", "is neither"),
    ("Submitted [http://github.com/vllm-project/vllm/pull/1]", "is neither"),
    ("Inappropriate", "needs a reason"),
    ("Inappropriate [ ]", "the bracket is empty"),
    ("Pending[soon]", "not in Yocto's vocabulary"),
])
def test_status_outside_the_vocabulary_is_refused(tmp_path: Path, status: str, says: str):
    proc = lint(series_of(tmp_path, trailers=[f"Upstream-Status: {status}",
                                              f"Signed-off-by: {AUTHOR}"]))
    assert proc.returncode == 1
    assert says in proc.stderr


def test_two_statuses_are_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, trailers=["Upstream-Status: Pending",
                                              f"Upstream-Status: Submitted [{PR}]",
                                              f"Signed-off-by: {AUTHOR}"]))
    assert proc.returncode == 1
    assert "2 Upstream-Status trailers" in proc.stderr


def test_missing_status_is_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, trailers=[f"Signed-off-by: {AUTHOR}"]))
    assert proc.returncode == 1
    assert "no `Upstream-Status:` trailer" in proc.stderr


def test_status_in_the_prose_is_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, body="Why.\n\nUpstream-Status: Pending\nmore prose\n"))
    assert proc.returncode == 1
    assert "outside the trailer block" in proc.stderr


def test_unsigned_mail_is_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, trailers=["Upstream-Status: Pending"]))
    assert proc.returncode == 1
    assert "no DCO `Signed-off-by" in proc.stderr


def test_sign_off_by_someone_else_only_is_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, trailers=["Upstream-Status: Pending",
                                              "Signed-off-by: Bob <bob@example.org>"]))
    assert proc.returncode == 1
    assert f"no Signed-off-by from its author {AUTHOR}" in proc.stderr


def test_subject_not_in_vllm_style_is_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, subject="Add foo"))
    assert proc.returncode == 1
    assert "not in vLLM's style" in proc.stderr


def test_patch_prefix_is_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, subject="[PATCH 1/2] [Model] Add foo"))
    assert proc.returncode == 1
    assert "[PATCH] prefix" in proc.stderr


def test_long_subject_is_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, subject="[Model] " + "x" * 70))
    assert proc.returncode == 1
    assert "(max 72)" in proc.stderr


def test_mail_without_body_is_refused(tmp_path: Path):
    proc = lint(series_of(tmp_path, body=""))
    assert proc.returncode == 1
    assert "no body saying why" in proc.stderr


def test_headerless_diff_is_refused(tmp_path: Path):
    patches = series_of(tmp_path)
    victim = patches / "Model-Foo.patch"
    text = victim.read_text()
    victim.write_text(text[text.index("diff --git "):])
    proc = lint(patches)
    assert proc.returncode == 1
    assert "not a git mail" in proc.stderr


def test_missing_file_is_refused(tmp_path: Path):
    patches = series_of(tmp_path)
    (patches / "Model-Foo.patch").unlink()
    proc = lint(patches)
    assert proc.returncode == 1
    assert "series lists Model-Foo.patch, which does not exist" in proc.stderr


def test_unlisted_patch_is_refused(tmp_path: Path):
    patches = series_of(tmp_path)
    (patches / "Bugfix-Stray.patch").write_text((patches / "Model-Foo.patch").read_text())
    proc = lint(patches)
    assert proc.returncode == 1
    assert "Bugfix-Stray.patch is in" in proc.stderr and "not listed in the series" in proc.stderr
