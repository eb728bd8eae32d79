# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 aux hidden states from the real vLLM v0.16.0 CPU engine, Kimi-K2.5.

The target is a tiny ``KimiK25ForConditionalGeneration`` checkpoint: the
multimodal wrapper (MoonViT vision tower + patch-merger projector, built and
loaded; image processor shipped as checkpoint code like the real one) around
an 8-layer DeepSeek-V3 text model. Prompts are text only.

The aux path is driven exactly as in test_eagle3_cpu_deepseek_v3.py (see its
docstring and _eagle3_cpu_harness.py): the GPU runner's load-time EAGLE-3
block runs against the real CPU model runner from a CPUWorker subclass, with
the draft config loaded by vLLM's SpeculativeConfig. Here the draft config
has NO ``eagle_aux_hidden_state_layer_ids``, so the runner falls back to the
model's ``get_eagle3_aux_hidden_state_layers()`` (2, n // 2, n - 3) =
(2, 4, 5), which the wrapper must delegate to its language model; the states
must then come through the wrapper's forward and match transformers'
DeepseekV3ForCausalLM run on the checkpoint's ``language_model.*`` weights.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Kimi",
    "Moonshot's K2.5 wraps a DeepSeek-V3 text model.",
    "Text-only prompts never reach the vision tower, but it is loaded.",
]
MAX_TOKENS = 8
STEP_TOKEN_BUDGET = 16
ATOL = 2e-4  # as for DeepSeek-V3 (same text model code, float32)
MIN_MARGIN = 100.0


@pytest.fixture(scope="module")
def kimi_run(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    return harness.run_prompts(
        tiny_ckpts["kimi"],
        tiny_ckpts["draft_default_ids"],
        PROMPTS,
        max_tokens=MAX_TOKENS,
        step_budget=STEP_TOKEN_BUDGET,
    )


def test_aux_states_match_hf_kimi_k25(
    harness: ModuleType,
    tiny_ckpts: dict[str, Any],
    kimi_run: dict[str, Any],
    record_property: Any,
) -> None:
    n = tiny_ckpts["kimi_layers"]
    rep = kimi_run["report"]
    assert rep["model_class"] == "KimiK25ForConditionalGeneration"
    # The whole wrapper was built and loaded, vision tower included.
    assert rep["children"]["vision_tower"] == "MoonViT3dPretrainedModel", rep["children"]
    assert rep["children"]["mm_projector"] == "KimiK25MultiModalProjector"
    assert rep["children"]["language_model"] == "DeepseekV2ForCausalLM"
    setup = rep["setup"]
    assert setup.source == "model default", setup
    default_ids = (2, n // 2, n - 3)
    hf_model = harness.load_hf_reference(
        tiny_ckpts["kimi"], prefix="language_model.", text_key="text_config"
    )
    assert hf_model.config.num_hidden_layers == n
    nums = harness.compare_aux_with_hf(hf_model, kimi_run, default_ids, ATOL)
    for key, value in nums.items():
        record_property(key, value)
    print(f"\nKimi-K2.5 aux vs HF (ATOL={ATOL}): {nums}")
    assert nums["max_abs_err"] <= ATOL, nums
    assert nums["margin"] >= MIN_MARGIN, nums
    assert nums["tokens_checked"] >= 0.9 * len(PROMPTS) * MAX_TOKENS, nums
    assert nums["token_mismatches"] == 0, nums
