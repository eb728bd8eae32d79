# SPDX-License-Identifier: Apache-2.0
"""Each mailbox in patches/proposed applies as its row in
patches/proposed/README.md says: to this repository as it stands ("main"),
or after another mailbox ("after NAME.mbox"). A clean copy of the repository
(its tracked files, as the working tree has them) gets the mailboxes with
`git am`, as the README tells a user to; the series that results must then
apply to the pinned sdist strictly (tools.apply: no fuzz, no offset), as the
build applies it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT, run_tool

PROPOSED = REPO_ROOT / "patches" / "proposed"
ROW = re.compile(r"^\| `(?P<mbox>[^`]+\.mbox)` \| (?P<applies>[^|]+?) \|", re.M)
AFTER = re.compile(r"^after `?(?P<mbox>[^`\s]+\.mbox)`?$")


def applies_to() -> dict[str, str | None]:
    """{mailbox: the mailbox it applies after, or None for main}, from the
    README's table; a row that says anything else is refused."""
    rows: dict[str, str | None] = {}
    for m in ROW.finditer((PROPOSED / "README.md").read_text()):
        applies = m["applies"].strip()
        if applies == "main":
            rows[m["mbox"]] = None
        elif after := AFTER.match(applies):
            rows[m["mbox"]] = after["mbox"]
        else:
            raise AssertionError(
                f"patches/proposed/README.md: {m['mbox']}'s 'applies to' is {applies!r};"
                " write main or after NAME.mbox")
    return rows


def chain(mbox: str, rows: dict[str, str | None]) -> list[str]:
    """The mailboxes to `git am`, in order, ending with ``mbox``."""
    order = [mbox]
    while (before := rows[order[0]]) is not None:
        assert before in rows, f"{order[0]} applies after {before}, which has no row"
        assert before not in order, f"'applies to' loops: {order}"
        order.insert(0, before)
    return order


def git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid",
         "-c", "commit.gpgsign=false", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def clean_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's tracked files as the working tree has them, committed
    into a new git repository (untracked and ignored files left out)."""
    files = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-z"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    repo = tmp_path_factory.mktemp("proposed") / "repo"
    for name in filter(None, files):
        src = REPO_ROOT / name
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / name)
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-q", "-m", "main")):
        assert git(repo, *args).returncode == 0
    return repo


def test_every_mailbox_has_a_row_and_every_row_a_mailbox():
    rows = applies_to()
    on_disk = sorted(p.name for p in PROPOSED.glob("*.mbox"))
    assert sorted(rows) == on_disk
    for mbox in rows:
        chain(mbox, rows)


def test_a_row_that_names_no_base_is_refused(monkeypatch, tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text("| `x.mbox` | the zero-bubble one | what | check |\n")
    monkeypatch.setattr(f"{__name__}.PROPOSED", tmp_path)
    with pytest.raises(AssertionError, match="write main or after NAME.mbox"):
        applies_to()


@pytest.mark.parametrize("mbox", sorted(applies_to()))
def test_mailbox_applies_as_its_row_says(mbox: str, clean_repo: Path, pristine_tree: Path,
                                         tmp_path: Path):
    repo = tmp_path / "repo"
    assert git(clean_repo, "clone", "-q", str(clean_repo), str(repo)).returncode == 0
    for name in chain(mbox, applies_to()):
        proc = git(repo, "am", "-q", str(PROPOSED / name))
        assert proc.returncode == 0, (
            f"{name} does not apply ({' then '.join(chain(mbox, applies_to()))}): "
            f"{proc.stderr.strip()}; refresh it (CONTRIBUTING.md, 'Refresh a patch')")
    # What the mails put in patches/ applies to upstream as the build applies it.
    tree = Path(shutil.copytree(pristine_tree, tmp_path / "tree"))
    proc = run_tool("apply", str(tree), "--series", str(repo / "patches" / "series"))
    assert proc.returncode == 0, f"{mbox}: the series does not apply strictly: {proc.stderr}"
