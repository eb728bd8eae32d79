"""Lint the series: every entry has a file, every patch file is listed, and
every patch is a git mail fit to send upstream.

    python -m tools.lint_series [--patches DIR]
    python -m tools.lint_series --upstream-ruff [--offline]


A patch must carry the ``From <zero hash>`` mbox line and From/Date/Subject
headers of ``git format-patch``, a subject in vLLM's style (``[Tag] Text``, at
most 72 characters), a body saying why, a DCO ``Signed-off-by`` of its author
and exactly one ``Upstream-Status`` trailer in Yocto's vocabulary, with a
checkable reference (a vLLM PR or commit URL) where one is due: see
CONTRIBUTING.md, "Ground rules".

``--upstream-ruff`` also runs upstream's own lint over the files the series
touches: the ruff version the sdist's ``.pre-commit-config.yaml`` pins, with
the sdist's ``pyproject.toml``, on the stock tree and on the patched one. It
reports only what the series adds (a ruff-check finding the stock file lacks,
a file stock ruff-format leaves alone and the patched one does not), so a mail
upstream's pre-commit would reject fails here. That ruff is installed once
into the download cache with pip.
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tools._common import (
    PATCHES_DIR, StackError, cache_dir, parser, read_series, run_main, say,
)

TOOL = "lint"
ZERO_FROM = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
SUBJECT_RE = re.compile(r"^(\[[A-Za-z0-9][A-Za-z0-9 ._/+-]*\])+ \S")
STATUS_RE = re.compile(r"^(?P<kw>\S+?)(?: \[(?P<arg>[^\[\]]*)\])?$")
# keyword -> its bracket holds: "ref" (required, checkable), "reason"
# (required, free text) or "optional" (free text, may be left out).
STATUS_KINDS = {
    "Pending": "optional", "Submitted": "ref", "Accepted": "optional",
    "Backport": "ref", "Denied": "optional", "Inappropriate": "reason",
    "Inactive-Upstream": "optional",
}
REF_RE = re.compile(r"https://github\.com/vllm-project/vllm/"
                    r"(?:pull/[1-9]\d*|commit/[0-9a-f]{7,40})")
URL_RE = re.compile(r"\w+://\S+")
# Trailers that mean something to this stack only: export_series
# --for-upstream drops them.
DOWNSTREAM_TRAILERS = ("Upstream-Status",)
VOCABULARY = " | ".join(f"{k} [...]" if v != "optional" else k
                        for k, v in STATUS_KINDS.items())
SOB_RE = re.compile(r"^Signed-off-by: (.+ <[^<>@\s]+@[^<>\s]+>)$")
MAX_SUBJECT = 72


def check_status(value: str) -> str | None:
    """What is wrong with one Upstream-Status value, or None."""
    m = STATUS_RE.match(value)
    kind = STATUS_KINDS.get(m.group("kw")) if m else None
    if not m or kind is None:
        return (f"Upstream-Status {value!r} is not in Yocto's vocabulary "
                f"({VOCABULARY}; a bracket follows after one space)")
    kw, arg = m.group("kw"), (m.group("arg") or "").strip()
    if m.group("arg") is not None and not arg:
        return f"Upstream-Status {value!r}: the bracket is empty"
    if kind == "reason" and not arg:
        return f"Upstream-Status {value!r} needs a reason: `{kw} [why upstream does not want it]`"
    if kind == "ref":
        urls = URL_RE.findall(arg)
        bad = [u for u in urls if not REF_RE.fullmatch(u.rstrip(",;"))]
        if not urls or bad:
            return (f"Upstream-Status {value!r} cites no checkable reference: write "
                    f"`{kw} [https://github.com/vllm-project/vllm/pull/<N>]` or "
                    f"`{kw} [https://github.com/vllm-project/vllm/commit/<sha>]`"
                    + (f" ({', '.join(bad)} is neither)" if bad else
                       " (a version number alone says nothing anyone can check)"))
    return None


def lint_patch(path: Path) -> list[str]:
    text = path.read_bytes().decode("utf-8", "replace")
    if not text.startswith(ZERO_FROM):
        return ["not a git mail exported by tools.export_series "
                "(first line must be the zero-hash `From ` line)"]
    head, sep, rest = text.partition("\n---\n")
    if not sep:
        rest, head = text, text.split("\ndiff --git ", 1)[0]
    msg = email.message_from_string(head[len(ZERO_FROM):], policy=email.policy.default)
    author, subject = msg.get("From"), msg.get("Subject")
    if not author or not msg.get("Date") or not subject:
        return ["lacks a From, Date or Subject header"]
    problems: list[str] = []
    subject = re.sub(r"\s+", " ", str(subject)).strip()
    if subject.startswith("[PATCH"):
        problems.append(f"subject {subject!r} carries a [PATCH] prefix; export with "
                        "--keep-subject")
    elif not SUBJECT_RE.match(subject):
        problems.append(f"subject {subject!r} is not in vLLM's style `[Tag] Summary` "
                        "(e.g. `[Model] ...`, `[Spec Decode] ...`)")
    if len(subject) > MAX_SUBJECT:
        problems.append(f"subject is {len(subject)} characters (max {MAX_SUBJECT})")
    lines = msg.get_payload().rstrip("\n").split("\n")
    trailers: list[str] = []
    while lines and lines[-1].strip():
        trailers.insert(0, lines.pop())
    if not "\n".join(lines).strip():
        problems.append("the message has no body saying why the patch exists")
    if not trailers:
        problems.append("no trailer block (Upstream-Status, Signed-off-by)")
    sobs = [m.group(1) for t in trailers if (m := SOB_RE.match(t))]
    if not sobs:
        problems.append("no DCO `Signed-off-by: Name <email>` trailer "
                        "(vLLM requires one; commit with `git commit -s`)")
    elif email.utils.parseaddr(str(author))[1] not in (email.utils.parseaddr(s)[1] for s in sobs):
        problems.append(f"no Signed-off-by from its author {author}")
    statuses = [t.split(":", 1)[1].strip() for t in trailers
                if t.lower().startswith("upstream-status:")]
    if any(ln.lower().startswith("upstream-status:") for ln in lines):
        problems.append("an Upstream-Status line outside the trailer block "
                        "(the trailers are the last paragraph of the message)")
    if not statuses:
        problems.append(f"no `Upstream-Status:` trailer ({VOCABULARY})")
    elif len(statuses) > 1:
        problems.append(f"{len(statuses)} Upstream-Status trailers; a mail has exactly one")
    problems.extend(p for s in statuses if (p := check_status(s)))
    if "\ndiff --git a/" not in rest and not rest.startswith("diff --git a/"):
        problems.append("contains no `diff --git a/... b/...` section")
    if not text.endswith("\n"):
        problems.append("does not end with a newline")
    return problems


def lint(patches: Path) -> list[str]:
    try:
        names = read_series(patches / "series")
    except StackError as e:
        return [str(e)]
    problems: list[str] = []
    seen: set[str] = set()
    for n in names:
        if n in seen:
            problems.append(f"series lists {n} twice")
        seen.add(n)
        if "/" in n or not n.endswith(".patch"):
            problems.append(f"series entry {n!r} must be a file name ending in .patch")
        elif not (patches / n).is_file():
            problems.append(f"series lists {n}, which does not exist in {patches}")
        else:
            problems.extend(f"{n}: {p}" for p in lint_patch(patches / n))
    problems.extend(f"{f.name} is in {patches} but not listed in the series"
                    for f in sorted(patches.glob("*.patch")) if f.name not in seen)
    return problems


RUFF_REV_RE = re.compile(r"repo: https://github\.com/astral-sh/ruff-pre-commit\s*\n"
                         r"\s*rev: v?(?P<version>[0-9][0-9.]*)\s*\n")


def ruff_pin(pre_commit_config: Path) -> str:
    """The ruff version upstream's pre-commit runs (ruff-pre-commit's rev)."""
    m = RUFF_REV_RE.search(pre_commit_config.read_text())
    if not m:
        raise StackError(f"{pre_commit_config} names no astral-sh/ruff-pre-commit rev")
    return m.group("version")


def ensure_ruff(version: str, *, offline: bool) -> Path:
    """The ``ruff`` executable of ``version``, installed with pip into the
    download cache the first time it is needed."""
    target = cache_dir() / f"ruff-{version}"
    exe = target / "bin" / "ruff"
    if not exe.is_file():
        if offline:
            raise StackError(f"ruff {version} (upstream's pre-commit pin) is not in "
                             f"{target}; run once without --offline to install it")
        say(TOOL, f"installing ruff=={version} (upstream's pre-commit pin) into {target}")
        subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check",
                        "install", "-q", "--target", str(target), f"ruff=={version}"],
                       check=True)
    got = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                         check=True).stdout.split()
    if got[-1:] != [version]:
        raise StackError(f"{exe} is ruff {got[-1:]}, not upstream's {version}; "
                         f"remove {target} and rerun")
    return exe


def _ruff_check(ruff: Path, tree: Path, files: list[str]) -> list[dict]:
    proc = subprocess.run([str(ruff), "check", "--no-cache", "--no-fix",
                           "--output-format", "json", "--exit-zero", *files],
                          cwd=tree, capture_output=True, text=True)
    if proc.returncode:
        raise StackError(f"ruff check failed in {tree}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def _ruff_format_diff(ruff: Path, tree: Path, file: str) -> str:
    proc = subprocess.run([str(ruff), "format", "--no-cache", "--diff", file],
                          cwd=tree, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise StackError(f"ruff format failed on {file}: {proc.stderr.strip()}")
    return proc.stdout


def upstream_ruff(patches: Path, *, offline: bool) -> list[str]:
    """What upstream's pinned ruff, with upstream's configuration, finds in
    the files the series touches that it does not find in stock v0.16.0."""
    from tools.apply import apply_series
    from tools.source import unpack_sdist

    with tempfile.TemporaryDirectory(prefix="lint-ruff-") as tmp:
        stock, patched = Path(tmp) / "stock", Path(tmp) / "patched"
        unpack_sdist(stock, offline=offline)
        unpack_sdist(patched, offline=offline)
        files = [p for p in apply_series(patched, patches / "series") if p.endswith(".py")]
        ruff = ensure_ruff(ruff_pin(stock / ".pre-commit-config.yaml"), offline=offline)
        old = [f for f in files if (stock / f).is_file()]

        def key(d: dict, root: Path) -> tuple[str, str, str]:
            return (str(Path(d["filename"]).relative_to(root)), d["code"] or "", d["message"])

        base = Counter(key(d, stock) for d in _ruff_check(ruff, stock, old)) if old else Counter()
        problems: list[str] = []
        for d in _ruff_check(ruff, patched, files):
            k = key(d, patched)
            if base[k]:
                base[k] -= 1
                continue
            row = d["location"]["row"]
            problems.append(f"ruff {d['code']} at {k[0]}:{row}: {d['message']} "
                            "(upstream's pre-commit runs `ruff check`)")
        for f in files:
            diff = _ruff_format_diff(ruff, patched, f)
            if diff and not (f in old and _ruff_format_diff(ruff, stock, f)):
                problems.append(f"ruff format would change {f} (upstream's pre-commit runs "
                                f"`ruff format`):\n{diff.rstrip()}")
        say(TOOL, f"ruff {ruff_pin(stock / '.pre-commit-config.yaml')} with upstream's "
            f"pyproject.toml over the {len(files)} Python file(s) the series touches")
        return problems


def main() -> int:
    ap = parser("lint_series", __doc__, offline=True)
    ap.add_argument("--patches", type=Path, default=PATCHES_DIR)
    ap.add_argument("--upstream-ruff", action="store_true",
                    help="also run upstream's pinned ruff over the patched files and "
                         "report what the series adds")
    args = ap.parse_args()
    problems = lint(args.patches)
    if args.upstream_ruff and not problems:
        problems = upstream_ruff(args.patches, offline=args.offline)
    for p in problems:
        print(f"[{TOOL}] {p}", file=sys.stderr)
    n = len(read_series(args.patches / "series")) if (args.patches / "series").exists() else 0
    if problems:
        say(TOOL, f"{len(problems)} problem(s) in {n} patch(es)")
        return 1
    say(TOOL, f"{n} patch(es) in {args.patches}: all listed, all git mails with a vLLM-style "
        "subject, DCO sign-off and Upstream-Status"
        + ("; upstream's ruff finds nothing the series adds" if args.upstream_ruff else ""))
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
