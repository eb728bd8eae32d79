# SPDX-License-Identifier: Apache-2.0
"""tools.upstream_tests' verdict: read from pytest's own --junitxml files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools._common import StackError, junit_outcomes
from tools.upstream_tests import compare

TESTS = """
import pytest

def test_ok():
    pass

def test_broken_everywhere():
    assert {broken_everywhere}

def test_broken_by_series():
    assert {broken_by_series}

def test_fixed_by_series():
    assert {fixed}

@pytest.mark.skip(reason="needs a GPU")
def test_gpu():
    pass

@pytest.fixture
def bad_teardown():
    yield
    assert {teardown}

def test_teardown(bad_teardown):
    pass
"""


def outcomes(tmp_path: Path, name: str, **values: bool) -> dict[str, tuple[str, str]]:
    (tmp_path / name).mkdir()
    (tmp_path / name / "test_x.py").write_text(TESTS.format(**values))
    xml = tmp_path / f"{name}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", "test_x.py"], cwd=tmp_path / name, capture_output=True)
    return junit_outcomes(xml)


def test_new_failures_are_those_stock_does_not_have(tmp_path: Path):
    stock = outcomes(tmp_path, "stock", broken_everywhere=False, broken_by_series=True,
                     fixed=False, teardown=True)
    patched = outcomes(tmp_path, "patched", broken_everywhere=False, broken_by_series=False,
                       fixed=True, teardown=False)
    assert stock["test_x::test_gpu"][0] == "skipped"
    assert patched["test_x::test_ok"] == ("passed", "")
    # An error in teardown fails the test, even though its call passed.
    assert patched["test_x::test_teardown"][0] == "failed"
    new, both, fixed = compare(patched, stock)
    assert new == ["test_x::test_broken_by_series", "test_x::test_teardown"]
    assert both == ["test_x::test_broken_everywhere"]
    assert fixed == ["test_x::test_fixed_by_series"]


def test_missing_report_is_an_error(tmp_path: Path):
    with pytest.raises(StackError, match="pytest wrote no"):
        junit_outcomes(tmp_path / "none.xml")
