# SPDX-License-Identifier: Apache-2.0
"""GPU end-to-end suite: skip cleanly without a CUDA GPU, build tiny checkpoints.

Tests marked ``gpu`` need a CUDA GPU and a vLLM whose CUDA ops load: either the
real built wheel (``pip install dist/vllm-0.16.0+eagle3...whl``) or, on the
lent H200, the harness (tools/gpu_harness/device_run.sh) with vLLM's own
kernels built from the pinned sources. Without a GPU they are skipped with
the reason, so ``pytest tests/e2e/gpu`` in CI runs the harness's CPU tests:
the FlashMLA sparse stand-ins (test_harness_dsa_ops.py), their start-up hook, the
projection and the step breakdown.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# gpu_e2e_helpers.py sits beside this file; appended (not prepended) so the
# installed vllm keeps precedence, and importable in either pytest import mode.
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))
import gpu_e2e_helpers  # noqa: E402 - also puts tools/ and tools/gpu_harness on sys.path


# Ask NVML, not the CUDA driver: initialising CUDA in this process before
# vLLM forks its engine core leaves the child's CUDA unusable.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def _cuda_reason() -> str | None:
    try:
        import torch
    except Exception as e:  # pragma: no cover
        return f"torch is not importable: {e}"
    if not torch.cuda.is_available():
        return (
            "needs a CUDA GPU (torch.cuda.is_available() is False). Run the GPU "
            "suite on a GPU machine with the built wheel installed "
            "(pytest -m gpu tests/e2e/gpu) or on the lent device through "
            "tools/gpu_harness/device_run.sh; see docs/gpu.md"
        )
    return None


def pytest_generate_tests(metafunc):
    # Every op test that takes `device` runs on the CPU, and on CUDA if present.
    if "device" in metafunc.fixturenames:
        import torch

        cuda = ["cuda"] if torch.cuda.is_available() else []
        metafunc.parametrize("device", ["cpu", *cuda])


def pytest_collection_modifyitems(config, items):
    reason = _cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> Path:
    """Where the GPU tests write their numbers (JSON); the harness points it
    at the device call's $OUT via EAGLE3_GPU_RESULTS_DIR."""
    d = os.environ.get("EAGLE3_GPU_RESULTS_DIR")
    path = Path(d) if d else tmp_path_factory.mktemp("gpu-results")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """Tiny seeded random checkpoints (tools/tiny_checkpoints.py)."""
    return gpu_e2e_helpers.make_checkpoints(tmp_path_factory.mktemp("tiny-ckpts"))
