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

ME = ("Grace Hopper", "grace@example.org")
ME_ADDR = f"{ME[0]} <{ME[1]}>"
TOOL_ADDR = "vLLM EAGLE-3 Stack <eagle3-stack@users.noreply.github.com>"


def identity_env(tmp_path: Path, name: str | None, mail: str | None) -> dict[str, str]:
    cfg = tmp_path / "gitconfig"
    cfg.write_text("[user]\n" + (f"\tname = {name}\n" if name else "")
                   + (f"\temail = {mail}\n" if mail else ""))
    return {"GIT_CONFIG_GLOBAL": str(cfg), "GIT_CONFIG_NOSYSTEM": "1",
            "PYTHONPATH": str(REPO_ROOT)}


def export(tmp_path: Path, out: Path, patches: Path | None = None, *, who=ME):
    # Run outside the checkout: only the sender's global identity counts.
    args = ["--for-upstream", str(out)] + (["--patches", str(patches)] if patches else [])
    return run_tool("export_series", *args, env=identity_env(tmp_path, *who), cwd=tmp_path)


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
    proc = export(tmp_path, tmp_path / "out", patches)
    assert proc.returncode == 0, proc.stderr
    got = (tmp_path / "out" / "0001-Model-Foo.patch").read_text()
    want = original.replace(f"From: {TOOL_ADDR}", f"From: {ME_ADDR}").replace(
        "Upstream-Status: Pending\n", "").replace(
        f"Signed-off-by: {TOOL_ADDR}\n", f"Signed-off-by: {ME_ADDR}\n")
    assert got == want
    assert (tmp_path / "out" / "series").read_text() == "0001-Model-Foo.patch\n"
    assert (patches / "Model-Foo.patch").read_text() == original


@pytest.mark.parametrize("who", [(None, None), ("Grace Hopper", None), (None, "g@example.org")])
def test_unset_identity_is_refused(tmp_path: Path, who):
    proc = export(tmp_path, tmp_path / "out", who=who)
    assert proc.returncode == 1
    assert "git config user.name and user.email must name you" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_non_empty_output_is_refused(tmp_path: Path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine").write_text("keep")
    proc = export(tmp_path, tmp_path / "out")
    assert proc.returncode == 1
    assert "is not empty" in proc.stderr


def _strip_ours(mail: str) -> str:
    """A mail without the lines the export may change."""
    return re.sub(r"(?m)^(From: |Signed-off-by: |Upstream-Status: ).*\n", "", mail)


def test_real_series_git_ams_onto_the_sdist_as_the_sender(tmp_path: Path):
    from tools._common import read_series
    from tools.import_series import am_series, make_base

    series = REPO_ROOT / "patches" / "series"
    before = {n: (REPO_ROOT / "patches" / n).read_bytes() for n in read_series(series)}
    out = tmp_path / "out"
    proc = export(tmp_path, out)
    assert proc.returncode == 0, proc.stderr
    assert {n: (REPO_ROOT / "patches" / n).read_bytes() for n in read_series(series)} == before

    exported = read_series(out / "series")
    assert len(exported) == len(before)
    for (name, orig), new in zip(before.items(), exported):
        assert new == f"{exported.index(new) + 1:04d}-{name}"
        assert _strip_ours((out / new).read_text()) == _strip_ours(orig.decode())

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
        folded = email.parser.HeaderParser().parsestr(orig.decode())["Subject"]
        orig_subject = " ".join(folded.split())
        assert subject == orig_subject and subject.startswith("[")
        assert "Upstream-Status" not in message
        assert message.rstrip().splitlines()[-1] == f"Signed-off-by: {ME_ADDR}"
        assert TOOL_ADDR not in message
