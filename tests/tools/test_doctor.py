# SPDX-License-Identifier: Apache-2.0
"""tools/doctor.py against the vLLM under test: every architecture OK.

Fails on stock v0.16.0 by design (the doctor reports the three walls there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCTOR = REPO_ROOT / "tools" / "doctor.py"
ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekForCausalLM",
    "DeepseekV3ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "KimiK25ForConditionalGeneration",
)


def run_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("EAGLE3_DOCTOR_DEBUG", None)
    return subprocess.run(
        [sys.executable, str(DOCTOR), *args],
        cwd=REPO_ROOT / "tools",  # never let a repo-root vllm/ shadow the install
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_doctor_reports_every_architecture_ok():
    import vllm

    doctor = run_doctor()
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    lines = doctor.stdout.splitlines()
    assert lines[0].startswith("vllm: ")
    assert str(Path(vllm.__file__).resolve()) in lines[0]
    assert f"(version {vllm.__version__})" in lines[0]
    arch_lines = [line for line in lines if line.startswith(("OK", "FAIL"))]
    assert len(arch_lines) == len(ARCHITECTURES)
    for arch in ARCHITECTURES:
        (line,) = [x for x in arch_lines if x.split()[1] == arch]
        assert line.startswith("OK "), line
        assert "FAIL" not in line and "[wall" not in line, line
        for check in ("allow-list=ok", "interface=ok", "aux-capture=ok"):
            assert check in line, line
    kimi = next(x for x in arch_lines if "KimiK25ForConditionalGeneration" in x)
    assert "image-token=ok(163605)" in kimi
    assert lines[-1].startswith("summary: EAGLE-3 ready")
    # Nothing else on stdout: no FAIL, no note about a shadowing source tree.
    for line in lines:
        assert line.startswith(("vllm: ", "OK ", "summary: ")), line

    help_result = run_doctor("--help")
    assert help_result.returncode == 0
    assert "usage:" in help_result.stdout and "--arch" in help_result.stdout
