# SPDX-License-Identifier: Apache-2.0
"""The layering rule of CONTRIBUTING.md, checked by import-linter
(.importlinter): tools/ is one job per module above the shared helpers, and
tools/gpu_harness/ one module per job above its engine, training and data
modules. No module imports one that imports it back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tools._common import REPO_ROOT


def _lint(root: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.exists(), (f"{exe} is missing: import-linter belongs in the cpu venv "
                          "(python -m tools.testenv cpu installs it)")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(exe), "--config", str(root / ".importlinter"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True)


def test_the_tools_keep_their_layers():
    r = _lint(REPO_ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "3 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "tools", root / "tools",
                    ignore=shutil.ignore_patterns("results", "__pycache__", "*.json", "*.txt"))
    shutil.copy(REPO_ROOT / ".importlinter", root / ".importlinter")
    return root


def test_a_helper_importing_a_job_is_refused(tmp_path):
    """The contract can fail: the shared engine importing a job (the circle
    the split removed) breaks the harness's layers."""
    root = _copy(tmp_path)
    engine = root / "tools" / "gpu_harness" / "engine.py"
    engine.write_text(engine.read_text() + "\nfrom tools.gpu_harness import bench_eagle3  # noqa: E402,F401\n")
    r = _lint(root)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "tools.gpu_harness.engine -> tools.gpu_harness.bench_eagle3" in r.stdout, r.stdout[-3000:]


def test_two_jobs_importing_each_other_are_refused(tmp_path):
    root = _copy(tmp_path)
    loo = root / "tools" / "loo.py"
    loo.write_text(loo.read_text() + "\nimport tools.doctor  # noqa: E402,F401\n")
    r = _lint(root)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "tools.loo -> tools.doctor" in r.stdout, r.stdout[-3000:]


def test_a_new_module_must_be_given_a_layer(tmp_path):
    root = _copy(tmp_path)
    (root / "tools" / "gpu_harness" / "newjob.py").write_text("X = 1\n")
    r = _lint(root)
    assert r.returncode == 1 and "newjob" in r.stdout + r.stderr, r.stdout[-2000:]
