"""Export the commits on top of ``stack-base`` back into patches/.

    python -m tools.export_series DIR [--check]
    python -m tools.export_series --for-upstream OUT

``git format-patch`` runs with fixed options, whatever the user's git config
says; a file is named after its subject without format-patch's ``NNNN-`` (the
series file is the only order), and patches/series keeps its leading
comments. Re-exporting an unchanged import reproduces every patch byte for
byte; ``--check`` proves that without writing anything.

``--for-upstream OUT`` writes the series' mails with you as From and signer
and without ``Upstream-Status:``, numbered, for ``git am --keep-non-patch``
(CONTRIBUTING.md, "Send a patch upstream").
"""

from __future__ import annotations

import email.utils
import re
import subprocess
import tempfile
from pathlib import Path

from tools._common import PATCHES_DIR, StackError, parser, read_series, run_main, say
from tools.import_series import BASE_TAG, git
from tools.lint_series import DOWNSTREAM_TRAILERS

TOOL = "export"
# git() hides the user's and the system's git config; pin what the
# repository's own config could still change.
FORMAT_PATCH = [
    "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
    "-c", "format.numbered=false", "-c", "format.coverLetter=false",
    "-c", "format.suffix=.patch",
    "format-patch", "--no-to", "--no-cc", "--no-thread", "--keep-subject", "--no-stat",
    "--no-signature", "--zero-commit", "--full-index", "--find-renames",
    "--diff-algorithm=myers", "--no-color", "-U3", "--src-prefix=a/", "--dst-prefix=b/",
    "--no-notes", "--no-base",
]


def export(repo: Path) -> dict[str, bytes]:
    """{file name: bytes} for the commits in stack-base..HEAD, in order."""
    if git(repo, "rev-parse", "-q", "--verify", f"refs/tags/{BASE_TAG}",
           check=False).returncode != 0:
        raise StackError(f"{repo} has no tag {BASE_TAG}: make it with tools.import_series")
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, bytes] = {}
        for f in git(repo, *FORMAT_PATCH, "-o", tmp, f"{BASE_TAG}..HEAD").stdout.split():
            name = re.sub(r"^\d{4}-", "", Path(f).name)
            if name in result:
                raise StackError(f"two commits would both export as {name}: "
                                 "give them distinct subjects")
            result[name] = Path(f).read_bytes()
    return result


def sender() -> str:
    """``Name <email>`` from the user's git config."""
    name, mail = (subprocess.run(["git", "config", key], capture_output=True,
                                 text=True).stdout.strip() for key in ("user.name", "user.email"))
    if not (name and mail):
        raise StackError("git config user.name and user.email must name you, the sender "
                         "(the sign-off certifies your right to submit): `git config "
                         "--global user.name 'Your Name'`, `git config --global "
                         "user.email you@example.org`")
    return email.utils.formataddr((name, mail))


def for_upstream(mail: str, me: str) -> str:
    """The mail with ``me`` as From and as the sign-off in place of the
    author's, and without downstream trailers; every other byte as it was."""
    head, sep, rest = mail.partition("\n\n")
    if not sep or not head.startswith("From "):
        raise StackError("not a git mail (no mbox `From ` line and headers)")
    headers: list[str] = []
    author = ""
    for line in head.split("\n"):
        if line[:1] in (" ", "\t") and headers and headers[-1].startswith("From: "):
            author += line  # a folded From header
            continue
        if line.startswith("From: "):
            author, line = line[len("From: "):], f"From: {me}"
        headers.append(line)
    author_addr = email.utils.parseaddr(author)[1].lower()
    cut = min((i for i in (rest.find("\n---\n"), rest.find("\ndiff --git ")) if i >= 0),
              default=len(rest))
    message, diff = rest[:cut + 1], rest[cut + 1:]
    body, _, trailers = message.rstrip("\n").rpartition("\n\n")
    tail = message[len(message.rstrip("\n")):]
    drop = {t.lower() for t in DOWNSTREAM_TRAILERS}
    kept = []
    for t in trailers.split("\n"):
        key, _, value = t.partition(":")
        if key.strip().lower() in drop or (key.strip().lower() == "signed-off-by" and
                                           email.utils.parseaddr(value)[1].lower() == author_addr):
            continue
        kept.append(t)
    if f"Signed-off-by: {me}" not in kept:
        kept.append(f"Signed-off-by: {me}")
    return "\n".join(headers) + sep + body + "\n\n" + "\n".join(kept) + tail + diff


def export_for_upstream(patches: Path, out: Path, me: str) -> list[Path]:
    if out.exists() and any(out.iterdir()):
        raise StackError(f"{out} is not empty; choose a new directory (nothing was written)")
    names = read_series(patches / "series")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for n, name in enumerate(names, 1):
        try:
            mail = for_upstream((patches / name).read_text(), me)
        except StackError as e:
            raise StackError(f"{name}: {e}") from None
        written.append(out / f"{n:04d}-{name}")
        written[-1].write_text(mail)
    (out / "series").write_text("".join(f"{p.name}\n" for p in written))
    return written


def series_text(old: Path, names: list[str]) -> str:
    header: list[str] = []
    for line in old.read_text().splitlines() if old.exists() else ():
        if line.strip() and not line.startswith("#"):
            break
        header.append(line)
    return "".join(f"{line}\n" for line in header + names)


def main() -> int:
    ap = parser("export_series", __doc__)
    ap.add_argument("dir", type=Path, nargs="?", help="repository made by tools.import_series")
    ap.add_argument("--patches", type=Path, default=PATCHES_DIR)
    ap.add_argument("--check", action="store_true",
                    help="write nothing; fail unless patches/ already matches")
    ap.add_argument("--for-upstream", type=Path, metavar="OUT",
                    help="write the series' mails, ready to send, into OUT (new or empty)")
    args = ap.parse_args()
    if args.for_upstream:
        if args.dir or args.check:
            ap.error("--for-upstream reads patches/; it takes no DIR and no --check")
        me = sender()
        written = export_for_upstream(args.patches, args.for_upstream, me)
        say(TOOL, f"{len(written)} mail(s) for upstream in {args.for_upstream}, from "
            f"{me}; apply with `git am --keep-non-patch {args.for_upstream}/*.patch`")
        return 0
    if args.dir is None:
        ap.error("give DIR (a repository made by tools.import_series) or --for-upstream OUT")
    patches = export(args.dir)
    series = args.patches / "series"
    new_series = series_text(series, list(patches)).encode()
    existing = {p.name: p.read_bytes() for p in args.patches.glob("*.patch")}
    changed = [n for n, b in patches.items() if existing.get(n) != b]
    removed = [n for n in existing if n not in patches]
    series_changed = not series.exists() or series.read_bytes() != new_series
    if args.check:
        for n in changed:
            say(TOOL, f"differs: {n}" if n in existing else f"missing: {n}")
        for n in removed:
            say(TOOL, f"not produced by the export: {n}")
        if series_changed:
            say(TOOL, "differs: series")
        if changed or removed or series_changed:
            say(TOOL, "round trip NOT byte-identical")
            return 1
        say(TOOL, f"round trip byte-identical: {len(patches)} patch(es) and series")
        return 0
    args.patches.mkdir(parents=True, exist_ok=True)
    for n in changed:
        (args.patches / n).write_bytes(patches[n])
        say(TOOL, f"{'updated' if n in existing else 'added'} {n}")
    for n in removed:
        (args.patches / n).unlink()
        say(TOOL, f"removed {n} (no longer a commit; it stays in git history)")
    if series_changed:
        series.write_bytes(new_series)
        say(TOOL, "rewrote series")
    say(TOOL, f"{len(patches)} patch(es) exported; {len(changed)} changed, "
        f"{len(removed)} removed")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
