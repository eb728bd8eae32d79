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
    assert "1 patch(es)" in proc.stdout


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


@pytest.mark.parametrize("mail, says", [
    ({"trailers": ["Upstream-Status: Pending", f"Upstream-Status: Submitted [{PR}]",
                   f"Signed-off-by: {AUTHOR}"]}, "2 Upstream-Status trailers"),
    ({"trailers": [f"Signed-off-by: {AUTHOR}"]}, "no `Upstream-Status:` trailer"),
    ({"body": "Why.\n\nUpstream-Status: Pending\nmore prose\n"}, "outside the trailer block"),
    ({"trailers": ["Upstream-Status: Pending"]}, "no DCO `Signed-off-by"),
    ({"trailers": ["Upstream-Status: Pending", "Signed-off-by: Bob <bob@example.org>"]},
     f"no Signed-off-by from its author {AUTHOR}"),
    ({"subject": "Add foo"}, "not in vLLM's style"),
    ({"subject": "[PATCH 1/2] [Model] Add foo"}, "[PATCH] prefix"),
    ({"subject": "[Model] " + "x" * 70}, "(max 72)"),
    ({"body": ""}, "no body saying why"),
], ids=["two-statuses", "no-status", "status-in-prose", "unsigned", "signed-by-other",
        "subject-style", "patch-prefix", "long-subject", "no-body"])
def test_a_broken_mail_is_refused(tmp_path: Path, mail: dict, says: str):
    proc = lint(series_of(tmp_path, **mail))
    assert proc.returncode == 1
    assert says in proc.stderr


@pytest.mark.parametrize("damage, says", [
    (lambda p: p.write_text("diff --git " + p.read_text().split("\ndiff --git ", 1)[1]),
     ["not a git mail"]),
    (lambda p: p.unlink(), ["series lists Model-Foo.patch, which does not exist"]),
    (lambda p: (p.parent / "Bugfix-Stray.patch").write_text(p.read_text()),
     ["Bugfix-Stray.patch is in", "not listed in the series"]),
], ids=["headerless-diff", "missing-file", "unlisted-patch"])
def test_a_broken_series_is_refused(tmp_path: Path, damage, says: list[str]):
    patches = series_of(tmp_path)
    damage(patches / "Model-Foo.patch")
    proc = lint(patches)
    assert proc.returncode == 1
    assert all(s in proc.stderr for s in says), proc.stderr


# --- upstream's own lint: its pinned ruff with its pyproject.toml ---

UTILS = "vllm/v1/spec_decode/utils.py"


def upstream_mail(pristine_tree: Path, tmp_path: Path, edit) -> Path:
    """A one-patch series changing UTILS of the sdist by ``edit(text)``."""
    import difflib

    old = (pristine_tree / UTILS).read_text()
    diff = "".join(difflib.unified_diff(
        old.splitlines(keepends=True), edit(old).splitlines(keepends=True),
        f"a/{UTILS}", f"b/{UTILS}",
    ))
    mail = write_mail(trailers=["Upstream-Status: Pending", f"Signed-off-by: {AUTHOR}"],
                      author=AUTHOR)
    mail = mail.split("diff --git ", 1)[0] + f"diff --git a/{UTILS} b/{UTILS}\n" + diff
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "Model-Foo.patch").write_text(mail)
    (patches / "series").write_text("Model-Foo.patch\n")
    return patches


def test_committed_series_passes_upstream_ruff():
    """Upstream's pre-commit (ruff check and ruff format at the pinned
    version) would take every patched file as the series leaves it."""
    proc = run_tool("lint_series", "--upstream-ruff")
    assert proc.returncode == 0, proc.stderr
    assert "ruff 0.14.0 with upstream's pyproject.toml" in proc.stdout, proc.stdout
    assert "upstream's ruff finds nothing the series adds" in proc.stdout


def test_upstream_ruff_reports_what_a_patch_adds(pristine_tree: Path, tmp_path: Path):
    def edit(text: str) -> str:
        # A stdlib import after the third-party ones (isort, I001) and a
        # function ruff format would rewrite.
        text = text.replace("import torch\n", "import torch\nimport copy\n", 1)
        return text + "\n\ndef _copy_of( x ):\n    return copy.copy( x )\n"

    proc = run_tool("lint_series", "--upstream-ruff", "--patches",
                    str(upstream_mail(pristine_tree, tmp_path, edit)))
    assert proc.returncode == 1, proc.stdout
    problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("[lint] ruff")]
    assert len(problems) == 2, proc.stderr
    assert f"ruff I001 at {UTILS}:" in problems[0]
    assert problems[1] == (f"[lint] ruff format would change {UTILS} (upstream's "
                           "pre-commit runs `ruff format`):")
    assert "+def _copy_of(x):" in proc.stderr


def test_upstream_ruff_passes_a_clean_change(pristine_tree: Path, tmp_path: Path):
    """Only what a patch adds counts: a clean edit of an upstream file passes."""
    def edit(text: str) -> str:
        return text + "\n\ndef _identity(x):\n    return x\n"

    proc = run_tool("lint_series", "--upstream-ruff", "--patches",
                    str(upstream_mail(pristine_tree, tmp_path, edit)))
    assert proc.returncode == 0, proc.stderr
    assert "upstream's ruff finds nothing the series adds" in proc.stdout
