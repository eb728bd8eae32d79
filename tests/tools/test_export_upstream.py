# SPDX-License-Identifier: Apache-2.0
"""tools.export_series --for-upstream: mails from the sender, without our
trailers, that `git am` onto the sdist tree (upstream's v0.16.0 stand-in)."""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
from pathlib import Path

import pytest

from stack_tooling import REPO_ROOT, run_tool, write_mail
from tools._common import PATCHES_DIR, read_series
from tools.import_series import TOOL_IDENT, am_series, make_base

ME_ADDR = "Grace Hopper <grace@example.org>"
TOOL_ADDR = "{} <{}>".format(*TOOL_IDENT)


def export(tmp_path: Path, patches: Path | None = None, name: str | None = "Grace Hopper",
           mail: str | None = "grace@example.org"):
    """Run outside the checkout, so that only the sender's global identity counts."""
    cfg = tmp_path / "gitconfig"
    cfg.write_text("[user]\n" + (f"\tname = {name}\n" if name else "")
                   + (f"\temail = {mail}\n" if mail else ""))
    env = {"GIT_CONFIG_GLOBAL": str(cfg), "GIT_CONFIG_NOSYSTEM": "1", "PYTHONPATH": str(REPO_ROOT)}
    return run_tool("export_series", "--for-upstream", str(tmp_path / "out"),
                    *(["--patches", str(patches)] if patches else []), env=env, cwd=tmp_path)


def test_rewrites_identity_and_drops_our_trailers_only(tmp_path: Path):
    patches = tmp_path / "patches"
    patches.mkdir()
    original = write_mail(author=TOOL_ADDR, body="Why.\n\nSigned-off-by: in prose stays\n",
                          trailers=["Upstream-Status: Pending",
                                    "Co-authored-by: Bob <bob@example.org>",
                                    "Signed-off-by: Bob <bob@example.org>",
                                    f"Signed-off-by: {TOOL_ADDR}"])
    (patches / "Model-Foo.patch").write_text(original)
    (patches / "series").write_text("Model-Foo.patch\n")
    proc = export(tmp_path, patches)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "0001-Model-Foo.patch").read_text() == original.replace(
        f"From: {TOOL_ADDR}", f"From: {ME_ADDR}").replace("Upstream-Status: Pending\n", "") \
        .replace(f"Signed-off-by: {TOOL_ADDR}\n", f"Signed-off-by: {ME_ADDR}\n")
    assert (tmp_path / "out" / "series").read_text() == "0001-Model-Foo.patch\n"
    assert (patches / "Model-Foo.patch").read_text() == original


@pytest.mark.parametrize("who", [(None, None), ("Grace Hopper", None), (None, "g@example.org")])
def test_unset_identity_is_refused(tmp_path: Path, who):
    proc = export(tmp_path, None, *who)
    assert proc.returncode == 1
    assert "git config user.name and user.email must name you" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_non_empty_output_is_refused(tmp_path: Path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine").write_text("keep")
    proc = export(tmp_path)
    assert proc.returncode == 1
    assert "is not empty" in proc.stderr


def test_real_series_git_ams_onto_the_sdist_as_the_sender(tmp_path: Path):
    before = {n: (PATCHES_DIR / n).read_bytes().decode() for n in read_series()}
    proc = export(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {n: (PATCHES_DIR / n).read_bytes().decode() for n in read_series()} == before
    out = tmp_path / "out"
    assert read_series(out / "series") == [f"{i:04d}-{n}" for i, n in enumerate(before, 1)]

    def strip_ours(mail: str) -> str:  # without the lines the export may change
        return re.sub(r"(?m)^(From: |Signed-off-by: |Upstream-Status: ).*\n", "", mail)

    for new, orig in zip(read_series(out / "series"), before.values()):
        assert strip_ours((out / new).read_text()) == strip_ours(orig)

    repo = tmp_path / "upstream"
    make_base(repo, offline=False)
    am_series(repo, out / "series")  # git am --keep-non-patch, as documented
    log = subprocess.run(
        ["git", "-C", str(repo), "log", "--reverse", "--format=%an <%ae>%x00%s%x00%B%x01",
         "stack-base..HEAD"], capture_output=True, text=True, check=True,
        env={**os.environ, "GIT_CONFIG_GLOBAL": os.devnull}).stdout
    commits = [c.strip("\n").split("\0") for c in log.split("\x01") if c.strip()]
    assert len(commits) == len(before)
    for (author, subject, message), orig in zip(commits, before.values()):
        assert author == ME_ADDR
        # Subject is a mail header: long ones are folded over two lines.
        assert subject == " ".join(email.parser.HeaderParser().parsestr(orig)["Subject"].split())
        assert subject.startswith("[")
        assert "Upstream-Status" not in message and TOOL_ADDR not in message
        assert message.rstrip().splitlines()[-1] == f"Signed-off-by: {ME_ADDR}"
