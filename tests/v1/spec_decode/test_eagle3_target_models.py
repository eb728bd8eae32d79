# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which target model types SpeculativeConfig accepts for method "eagle3":
the real validator (_verify_args) on stand-in target configs, and one full
SpeculativeConfig from tiny config files.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.config import ModelConfig, ParallelConfig
from vllm.config.speculative import SpeculativeConfig

FAMILY = [
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "glm_moe_dsa"
]
# Rejected before and still: including look-alikes a substring match would pass.
REJECTED = [
    "mistral", "gemma", "gemma3", "deepseek_vl_v2", "deepseek", "deepseek_v3_vl",
    "deepseek_v4", "kimi_vl", "kimi_linear", "glm4_moe", "glm_moe_dsa_v2", "mixtral",
]


def verify(model_type: str, top_level_model_type: str | None = None):
    return verify_target(
        SimpleNamespace(model_type=model_type),
        SimpleNamespace(model_type=top_level_model_type or model_type),
    )


def verify_target(hf_text_config, hf_config):
    """The real _verify_args for method eagle3 and the given target."""
    config = object.__new__(SpeculativeConfig)
    fields = {
        "tensor_parallel_size": None, "num_speculative_tokens": 3,
        "draft_model_config": None, "disable_by_batch_size": None, "method": "eagle3",
        "target_model_config": SimpleNamespace(
            hf_text_config=hf_text_config, hf_config=hf_config
        ),
    }
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config._verify_args()


# Kimi-K2.5: its text config is a DeepseekV3Config; the wrapper is kimi_k25.
@pytest.mark.parametrize(
    "model_type, top_level",
    [(t, None) for t in FAMILY] + [("deepseek_v3", "kimi_k25")],
    ids=FAMILY + ["kimi_k25_wrapper"],
)
def test_eagle3_accepts_deepseek_family(model_type, top_level):
    assert verify(model_type, top_level).method == "eagle3"


@pytest.mark.regression
@pytest.mark.parametrize(
    "model_type", ["llama", "qwen2", "qwen3_moe", "minicpm", "gpt_oss", "afmoe"]
)
def test_eagle3_still_accepts_existing_types(model_type):
    assert verify(model_type).method == "eagle3"


@pytest.mark.regression
@pytest.mark.parametrize("model_type", REJECTED)
def test_eagle3_still_rejects_other_types(model_type):
    with pytest.raises(ValueError, match="Eagle3 is only supported for") as exc_info:
        verify(model_type)
    assert repr(model_type) in str(exc_info.value)


def test_eagle3_rejection_lists_both_sets():
    with pytest.raises(ValueError) as exc_info:
        verify("mistral")
    msg = str(exc_info.value)
    assert "'llama'" in msg
    for model_type in FAMILY:
        assert repr(model_type) in msg
    assert "model_type='mistral'" in msg


def test_eagle3_family_member_inside_rejected_wrapper_is_not_enough():
    # Exact match only: a family name as a prefix/suffix gets nothing new.
    for model_type in ("deepseek_v3_mtp", "xdeepseek_v2", "kimi_k2_vl"):
        with pytest.raises(ValueError, match="Eagle3 is only supported for"):
            verify(model_type)
    # ...while the exact family names pass (so this test fails on stock).
    assert verify("deepseek_v3").method == "eagle3"


@pytest.mark.regression
def test_eagle3_rejects_deepseek_vl2_whose_text_config_is_deepseek_v2():
    # Matching the text model type would let DeepSeek-VL2 through, to fail
    # later at model load (DeepseekVLV2ForCausalLM has no aux capture).
    from vllm.transformers_utils.config import get_hf_text_config
    from vllm.transformers_utils.configs.deepseek_vl2 import DeepseekVLV2Config

    hf_config = DeepseekVLV2Config()
    text_config = get_hf_text_config(hf_config)
    assert hf_config.model_type == "deepseek_vl_v2"
    assert text_config.model_type == "deepseek_v2"
    with pytest.raises(ValueError, match="Eagle3 is only supported for"):
        verify_target(text_config, hf_config)


def test_speculative_config_accepts_deepseek_v3_target(tiny_config):
    target = tiny_config("deepseek_v3", "target", num_hidden_layers=4)
    ids = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    draft = tiny_config("llama_eagle3", "draft", **ids)
    target_config = ModelConfig(
        model=target, tokenizer=target, skip_tokenizer_init=True, dtype="bfloat16"
    )
    assert target_config.hf_text_config.model_type == "deepseek_v3"
    config = SpeculativeConfig(
        method="eagle3", model=draft, num_speculative_tokens=2,
        target_model_config=target_config, target_parallel_config=ParallelConfig(),
    )
    assert config.method == "eagle3"
    hf = config.draft_model_config.hf_config
    assert hf.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
