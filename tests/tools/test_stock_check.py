# SPDX-License-Identifier: Apache-2.0
"""tools.stock_check: the rule that makes the stock run mean something."""

from __future__ import annotations

import json
from pathlib import Path

from stack_tooling import run_tool


def _check(tmp_path: Path, report: dict[str, dict[str, object]]):
    path = tmp_path / "stock.json"
    path.write_text(json.dumps(report))
    return run_tool("stock_check", str(path))


def test_discriminating_report_passes(tmp_path: Path):
    proc = _check(tmp_path, {
        "t::feature": {"outcome": "failed", "regression": False},
        "t::unchanged": {"outcome": "passed", "regression": True},
        "t::cannot_run": {"outcome": "skipped", "regression": False},
    })
    assert proc.returncode == 0, proc.stderr
    assert "all 1 feature tests failed, all 1 regression tests passed" in proc.stdout


def test_feature_test_passing_on_stock_is_refused(tmp_path: Path):
    proc = _check(tmp_path, {"t::vacuous": {"outcome": "passed", "regression": False}})
    assert proc.returncode == 1
    assert "feature test passed on stock v0.16.0 (it must fail there): t::vacuous" in proc.stderr


def test_regression_test_failing_on_stock_is_refused(tmp_path: Path):
    proc = _check(tmp_path, {"t::mislabelled": {"outcome": "failed", "regression": True}})
    assert proc.returncode == 1
    assert "regression test failed on stock" in proc.stderr


def test_empty_report_is_refused(tmp_path: Path):
    proc = _check(tmp_path, {})
    assert proc.returncode == 1
    assert "lists no tests" in proc.stderr
