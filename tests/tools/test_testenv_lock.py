# SPDX-License-Identifier: Apache-2.0
"""The committed lock of the cpu venv is the one its requirements give.

A stale lock is no error (tools/testenv.py resolves anew and rewrites it), but
every CI run then resolves again, about a minute: this names the fix.
"""

from __future__ import annotations

import json

from tools._common import REPO_ROOT, load_pin
from tools.build_wheel import output_name
from tools.testenv import LOCK, cpu_requirements


def test_committed_lock_matches_the_cpu_wheels_requirements():
    wheel = REPO_ROOT / "dist" / output_name(load_pin(), arch="x86_64", cpu=True)
    inputs, digest = cpu_requirements(wheel)
    lock = json.loads(LOCK.read_text())
    assert lock["requirements_sha256"] == digest, (
        f"{LOCK.name} was resolved from other requirements: run `python -m "
        f"tools.testenv cpu --root /tmp/venvs` and commit the {LOCK.name} it writes")
    locked = {p.split("==")[0].lower() for p in lock["pins"]}
    assert {"torch", "pytest", "transformers"} <= locked
