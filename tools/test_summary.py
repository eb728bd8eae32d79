"""The last lines of ./test.sh: one per stage, then the total, from the
stages' JUnit XML.

    python -m tools.test_summary REPORTS STATUS1 STATUS2 STATUS3 STATUS4

REPORTS holds harness.xml (stage 1), upstream/patched.xml and
upstream/stock.xml (stage 2), series.xml (stage 3) and tooling.xml (stage
4); STATUSn is stage n's exit status. Stage 2 runs v0.16.0's own tests twice,
on the patched build and on stock: a test that fails on both is stock
v0.16.0's own failure (a missing optional package, no network), said so in
its line; only a failure on patched alone fails the stage.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tools._common import junit_outcomes, parser, run_main

TOOL = "test_summary"
STAGES = ("GPU harness, CPU tests", "vLLM v0.16.0's own tests, patched vs stock",
          "the series: unit and end-to-end on the CPU engine", "the stack's tooling")


def _counts(outcomes: dict[str, tuple[str, str]]) -> Counter:
    return Counter(o for o, _ in outcomes.values())


def _read(path: Path) -> dict[str, tuple[str, str]] | None:
    try:
        return junit_outcomes(path)
    except Exception:  # noqa: BLE001 - a stage that wrote no XML, or broken XML
        return None


def summary(reports: Path, statuses: list[int]) -> list[str]:
    lines, total = [], Counter()
    files = {1: reports / "harness.xml", 2: reports / "upstream" / "patched.xml",
             3: reports / "series.xml", 4: reports / "tooling.xml"}
    stock_own = 0
    for n, name in enumerate(STAGES, 1):
        verdict = "ok" if statuses[n - 1] == 0 else f"FAILED (exit {statuses[n - 1]})"
        got = _read(files[n])
        if got is None:
            lines.append(f"{n}/4 {name}: no results ({files[n]} missing); {verdict}")
            continue
        c = _counts(got)
        total.update(c)
        text = f"{c['passed']} passed, {c['skipped']} skipped, {c['failed']} failed"
        if n == 2:
            stock = _read(reports / "upstream" / "stock.xml") or {}
            both = sorted(t for t, (o, _) in got.items()
                          if o == "failed" and stock.get(t, ("",))[0] == "failed")
            stock_own = len(both)
            new = c["failed"] - stock_own
            text += (f": {stock_own} of the failures are stock v0.16.0's own (the same tests "
                     f"fail on stock), {new} new on patched")
        lines.append(f"{n}/4 {name}: {text}; {verdict}")
    ok = all(s == 0 for s in statuses)
    lines.append(f"total: {total['passed']} passed, {total['skipped']} skipped, "
                 f"{total['failed']} failed ({stock_own} of them stock v0.16.0's own); "
                 + ("ok" if ok else "FAILED"))
    return lines


def main() -> int:
    ap = parser(TOOL, __doc__)
    ap.add_argument("reports", type=Path)
    ap.add_argument("statuses", type=int, nargs=4)
    args = ap.parse_args()
    print("\n".join(summary(args.reports, args.statuses)))
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
