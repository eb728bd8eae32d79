# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the CPU end-to-end tests: engine environment, tiny checkpoints
and the harness module (_eagle3_cpu_harness.py says how the engine is driven)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

NAME = "eagle3_e2e_cpu_harness"  # == _eagle3_cpu_harness.HARNESS_MODULE


@pytest.fixture(scope="session")
def harness() -> ModuleType:
    if NAME not in sys.modules:
        path = Path(__file__).resolve().parent / "_eagle3_cpu_harness.py"
        spec = importlib.util.spec_from_file_location(NAME, path)
        assert spec and spec.loader
        # Registered before exec: vLLM resolves worker_cls by this module name.
        sys.modules[NAME] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[NAME])
    assert sys.modules[NAME].HARNESS_MODULE == NAME
    return sys.modules[NAME]


@pytest.fixture(scope="module", autouse=True)
def _cpu_engine_env(harness: ModuleType) -> Iterator[None]:
    """The in-process engine's environment, per module of this directory."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in harness.ENGINE_ENV.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="session")
def tiny_ckpts(
    harness: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Tiny seeded checkpoints written with tools/tiny_checkpoints.py."""
    write = harness.load_tiny_checkpoints().write_checkpoint
    root = tmp_path_factory.mktemp("tiny_ckpts")
    n = 6  # DeepSeek-V3 target depth: ids 0..6 are all distinct boundaries

    def draft(name: str, seed: int, ids: Any) -> Path:
        return write("eagle3-drafter", root / name, seed=seed, aux_layer_ids=ids).outdir

    return {
        "dsv3_layers": n, "kimi_layers": 8,
        "dsv3": write("deepseek-v3", root / "dsv3", seed=0).outdir,
        # Every boundary, including 0 (embedding) and n (pre-norm output).
        "draft_all_ids": draft("draft_all_ids", 1, range(n + 1)),
        "draft_bad_ids": draft("draft_bad_ids", 2, (1, 3, n + 1)),  # n + 1: refused
        # No ids: the target's default (2, n // 2, n - 3); Kimi gets 8 layers
        # so that is (2, 4, 5), without a duplicate.
        "draft_default_ids": draft("draft_default_ids", 3, None),
        "kimi": write("kimi-k25", root / "kimi", seed=4, num_hidden_layers=8).outdir,
    }
