"""Lint the series: every entry has a file, every patch file is listed, and
every patch is a git mail fit to send upstream.

    python -m tools.lint_series [--patches DIR]

A patch must carry the ``From <zero hash>`` mbox line and From/Date/Subject
headers of ``git format-patch``, a subject in vLLM's style (``[Tag] Text``, at
most 72 characters), a body saying why, a DCO ``Signed-off-by`` of its author
and exactly one ``Upstream-Status`` trailer in Yocto's vocabulary, with a
checkable reference (a vLLM PR or commit URL) where one is due: see
CONTRIBUTING.md, "Ground rules".
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import re
import sys
from pathlib import Path

from tools._common import PATCHES_DIR, StackError, parser, read_series, run_main, say

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


def main() -> int:
    ap = parser("lint_series", __doc__)
    ap.add_argument("--patches", type=Path, default=PATCHES_DIR)
    args = ap.parse_args()
    problems = lint(args.patches)
    for p in problems:
        print(f"[{TOOL}] {p}", file=sys.stderr)
    n = len(read_series(args.patches / "series")) if (args.patches / "series").exists() else 0
    if problems:
        say(TOOL, f"{len(problems)} problem(s) in {n} patch(es)")
        return 1
    say(TOOL, f"{n} patch(es) in {args.patches}: all listed, all git mails with a vLLM-style "
        "subject, DCO sign-off and Upstream-Status")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
