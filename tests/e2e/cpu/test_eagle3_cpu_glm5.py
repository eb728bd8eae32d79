# SPDX-License-Identifier: Apache-2.0
"""GLM-5 (glm_moe_dsa, GlmMoeDsaForCausalLM) on the vLLM v0.16.0 CPU engine.

GLM-5 cannot be served by this engine on CPU, for reasons that have nothing
to do with EAGLE-3; this test finds that out by really trying, and skips with
the exact failure (the GPU issue covers GLM-5):

1. transformers 4.57 (what vLLM 0.16 runs with) does not know model type
   ``glm_moe_dsa`` and vLLM 0.16 registers no config class for it, so a
   checkpoint in GLM-5's own format fails at config loading.
2. With the config class supplied as checkpoint code (``auto_map``,
   ``trust_remote_code``), model construction fails: GLM-5's DSA sparse
   attention indexer exists only in ``DeepseekV2MLAAttention``, which the CPU
   platform refuses ("MLA is not supported on CPU"), while the non-MLA
   ``DeepseekV2Attention`` asserts that no ``topk_indices_buffer`` (allocated
   for any config with ``index_topk``) is passed.

If a probe starts an engine, the skip reason is stale and the test fails so
that someone replaces it with a real aux-state check.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.e2e


def _start_failure(harness: ModuleType, **kwargs: Any) -> BaseException | None:
    try:
        with harness.running_engine(**kwargs):
            return None
    except Exception as exc:  # noqa: BLE001 - classified by the caller
        return exc


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return " ".join(text.split())[:300]


def test_glm5_aux_states_on_cpu_engine(
    harness: ModuleType, tiny_ckpts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    reasons: list[str] = []
    # Probe 1: the checkpoint as GLM-5 ships it.
    exc = _start_failure(
        harness,
        **harness.engine_kwargs(tiny_ckpts["glm5"], draft=tiny_ckpts["draft_glm5"]),
    )
    if exc is None:
        pytest.fail("GLM-5 now starts on the CPU engine: replace this skip with a real check")
    assert "glm_moe_dsa" in str(exc), _one_line(exc)
    reasons.append(
        f"transformers {transformers.__version__} cannot load its config "
        f"({_one_line(exc)[:160]})"
    )

    # Probe 2: config class from the checkpoint; MLA off (as the CPU needs) ...
    kwargs = harness.engine_kwargs(
        tiny_ckpts["glm5_remote_config"],
        draft=tiny_ckpts["draft_glm5"],
        trust_remote_code=True,
    )
    exc = _start_failure(harness, **kwargs)
    if exc is None:
        pytest.fail("GLM-5 now starts on the CPU engine: replace this skip with a real check")
    assert "topk_indices_buffer" in str(exc), _one_line(exc)
    reasons.append(
        "with the config supplied as checkpoint code and VLLM_MLA_DISABLE=1, "
        f"model construction fails ({_one_line(exc)}): the DSA indexer exists "
        "only in the MLA attention path"
    )
    # ... and MLA on (the only path with the sparse indexer).
    monkeypatch.setenv("VLLM_MLA_DISABLE", "0")
    exc = _start_failure(harness, **kwargs)
    if exc is None:
        pytest.fail("GLM-5 now starts on the CPU engine: replace this skip with a real check")
    assert "MLA is not supported on CPU" in str(exc), _one_line(exc)
    reasons.append(f"with MLA on, {_one_line(exc)}")

    pytest.skip(
        "GLM-5 (glm_moe_dsa) cannot run on the vLLM 0.16 CPU engine, so its "
        "EAGLE-3 aux states are covered by the GPU issue: " + "; ".join(reasons)
    )
