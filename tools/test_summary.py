"""Add up the outcome reports of test.sh's pytest runs into one closing line.

    python -m tools.test_summary REPORT.json [...] [--stock STOCK.json]

Exits non-zero if any test failed or none ran. The stock run is counted
separately: its feature tests are expected to fail (tools/stock_check.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools._common import run_main

TOOL = "summary"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.test_summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--stock", type=Path, default=None)
    args = ap.parse_args()
    total: Counter[str] = Counter()
    for r in args.reports:
        entries = json.loads(r.read_text()).values() if r.exists() else []
        # No report, or an empty one: the run broke before any test ran.
        counts = Counter(str(e.get("outcome")) for e in entries) or Counter({"failed": 1})
        # Collected but never run (a collection error stopped the session):
        # that is a failure of the run, not a pass.
        counts["failed"] += counts.pop("not-run", 0)
        print(f"[{TOOL}] {r.stem}: {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['skipped']} skipped")
        total += counts
    if args.stock and args.stock.exists():
        c = Counter(str(e.get("outcome")) for e in json.loads(args.stock.read_text()).values())
        print(f"[{TOOL}] stock (expected to fail): {c['failed']} failed as required, "
              f"{c['passed']} regression passed")
    print(f"summary: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0 if total["passed"] and not total["failed"] else 1


if __name__ == "__main__":
    run_main(TOOL, main)
