# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the CPU end-to-end tests: engine environment, tiny checkpoints
and the harness module (see _eagle3_cpu_harness.py for how the engine's aux
path is driven on CPU)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent


def _load_harness() -> ModuleType:
    name = "eagle3_e2e_cpu_harness"  # == _eagle3_cpu_harness.HARNESS_MODULE
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _HERE / "_eagle3_cpu_harness.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    # Registered before exec: vLLM resolves worker_cls by this module name.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    assert module.HARNESS_MODULE == name
    return module


@pytest.fixture(scope="session")
def harness() -> ModuleType:
    return _load_harness()


@pytest.fixture(scope="module", autouse=True)
def _cpu_engine_env(harness: ModuleType) -> Iterator[None]:
    """Environment of the in-process CPU engine, set per module of this
    directory and restored afterwards (other tests never see it)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in harness.ENGINE_ENV.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="session")
def tiny_ckpts(
    harness: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Tiny seeded checkpoints written on the fly with tools/tiny_checkpoints.py."""
    tc = harness.load_tiny_checkpoints()
    root = tmp_path_factory.mktemp("tiny_ckpts")
    n = 6  # DeepSeek-V3 target depth: ids 0..6 are all distinct boundaries
    made: dict[str, Any] = {"root": root, "dsv3_layers": n, "kimi_layers": 8}
    made["dsv3"] = tc.write_checkpoint("deepseek-v3", root / "dsv3", seed=0).outdir
    # Every layer boundary, including 0 (embedding) and n (pre-norm output).
    made["draft_all_ids"] = tc.write_checkpoint(
        "eagle3-drafter", root / "draft_all_ids", seed=1, aux_layer_ids=range(n + 1)
    ).outdir
    # One id past the end (n + 1): must be refused at engine start.
    made["draft_bad_ids"] = tc.write_checkpoint(
        "eagle3-drafter", root / "draft_bad_ids", seed=2, aux_layer_ids=(1, 3, n + 1)
    ).outdir
    # No ids: the runner falls back to the target's default layers. Kimi gets
    # 8 layers so the default (2, n // 2, n - 3) = (2, 4, 5) has no duplicate.
    made["draft_default_ids"] = tc.write_checkpoint(
        "eagle3-drafter", root / "draft_default_ids", seed=3, aux_layer_ids=None
    ).outdir
    made["kimi"] = tc.write_checkpoint(
        "kimi-k25", root / "kimi", seed=4, num_hidden_layers=made["kimi_layers"]
    ).outdir
    made["glm5"] = tc.write_checkpoint("glm5", root / "glm5", seed=5).outdir
    made["glm5_remote_config"] = tc.write_checkpoint(
        "glm5", root / "glm5_rc", seed=5, remote_code_config=True
    ).outdir
    made["draft_glm5"] = tc.write_checkpoint(
        "eagle3-drafter", root / "draft_glm5", seed=6, aux_layer_ids=(1, 3, n)
    ).outdir
    return made
