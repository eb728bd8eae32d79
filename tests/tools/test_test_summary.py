# SPDX-License-Identifier: Apache-2.0
"""tools/test_summary.py: ./test.sh's last lines, one per stage and a total,
and stage 2's failures that fail on stock too named as stock v0.16.0's own."""

from __future__ import annotations

from pathlib import Path

from tools.test_summary import summary


def junit(path: Path, **cases: str) -> None:
    """cases: test name -> passed | failed | skipped."""
    body = {"passed": "", "failed": '<failure message="boom"/>', "skipped": "<skipped/>"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("<testsuites><testsuite>" + "".join(
        f'<testcase classname="t" name="{n}">{body[o]}</testcase>' for n, o in cases.items())
        + "</testsuite></testsuites>")


def test_one_line_per_stage_and_a_total(tmp_path: Path) -> None:
    junit(tmp_path / "harness.xml", a="passed", b="skipped")
    junit(tmp_path / "upstream" / "patched.xml", a="passed", timm="failed", tt="failed")
    junit(tmp_path / "upstream" / "stock.xml", a="passed", timm="failed", tt="failed")
    junit(tmp_path / "series.xml", a="passed", b="passed")
    junit(tmp_path / "tooling.xml", a="passed")
    lines = summary(tmp_path, [0, 0, 0, 0])
    assert len(lines) == 5
    assert lines[0] == "1/4 GPU harness, CPU tests: 1 passed, 1 skipped, 0 failed; ok"
    assert lines[1].startswith("2/4 vLLM v0.16.0's own tests, patched vs stock: 1 passed, "
                               "0 skipped, 2 failed: 2 of the failures are stock v0.16.0's own")
    assert "0 new on patched; ok" in lines[1]
    assert lines[4] == "total: 5 passed, 1 skipped, 2 failed (2 of them stock v0.16.0's own); ok"


def test_a_new_failure_and_a_missing_stage(tmp_path: Path) -> None:
    junit(tmp_path / "upstream" / "patched.xml", timm="failed", mine="failed")
    junit(tmp_path / "upstream" / "stock.xml", timm="failed", mine="passed")
    lines = summary(tmp_path, [0, 1, 0, 0])
    assert lines[0].startswith("1/4 GPU harness, CPU tests: no results (")
    assert "1 of the failures are stock v0.16.0's own (the same tests fail on stock), " \
           "1 new on patched; FAILED (exit 1)" in lines[1]
    assert lines[-1].endswith("; FAILED")
