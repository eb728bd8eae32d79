# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Configs of model type kimi_k2 without configuration code.

Kimi-K2 checkpoints load through their own config class (auto_map,
trust_remote_code); the Kimi EAGLE-3 MLA drafters say model_type kimi_k2 but
ship no code, which transformers cannot load.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

K2 = dict(
    model_type="kimi_k2", hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=16, vocab_size=256, max_position_embeddings=128,
    n_routed_experts=None, torch_dtype="float32",
)
DRAFTER = dict(
    architectures=["Eagle3DeepseekV2ForCausalLM"], draft_vocab_size=128,
    eagle_aux_hidden_state_layer_ids=[1, 2, 4], **K2,
)
REMOTE_CODE = '''from transformers import PretrainedConfig

class RemoteKimiK2Config(PretrainedConfig):
    model_type = "kimi_k2"
'''


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_k2_configs")

    def write(name: str, **config) -> str:
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        return str(root / name)

    return SimpleNamespace(root=root, write=write)


def test_kimi_k2_config_without_code_loads_as_deepseek_v3(dirs):
    from transformers import DeepseekV3Config

    from vllm.transformers_utils.config import get_config

    path = dirs.write("drafter", **DRAFTER)
    config = get_config(path, trust_remote_code=False)
    assert isinstance(config, DeepseekV3Config)
    # The checkpoint's model type is kept (it is not a DeepSeek MTP module).
    assert config.model_type == "kimi_k2"
    assert config.kv_lora_rank == 16 and config.q_lora_rank == 32
    assert config.eagle_aux_hidden_state_layer_ids == [1, 2, 4]


@pytest.mark.regression
def test_kimi_k2_config_with_code_still_uses_its_code(dirs):
    from vllm.transformers_utils.config import get_config

    path = dirs.write(
        "with_code", architectures=["DeepseekV3ForCausalLM"],
        auto_map={"AutoConfig": "configuration_kimi.RemoteKimiK2Config"}, **K2,
    )
    (dirs.root / "with_code" / "configuration_kimi.py").write_text(REMOTE_CODE)
    config = get_config(path, trust_remote_code=True)
    assert type(config).__name__ == "RemoteKimiK2Config"
    assert config.model_type == "kimi_k2"


def test_kimi_k2_eagle3_drafter_is_an_mla_draft_model(dirs, monkeypatch):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    target = dirs.write("target", **{
        **K2, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1,
    })
    draft = dirs.write("kimi_drafter", **DRAFTER)
    # The registry's `python -m` subprocess must not import the repository
    # root's pristine vllm/ tree.
    monkeypatch.chdir(dirs.root)
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    config = SpeculativeConfig(
        method="eagle3", model=draft, num_speculative_tokens=3,
        target_model_config=ModelConfig(
            model=target, tokenizer=target, skip_tokenizer_init=True
        ),
        target_parallel_config=ParallelConfig(),
    )
    draft_config = config.draft_model_config
    assert draft_config.architecture == "Eagle3DeepseekV2ForCausalLM"
    assert draft_config.hf_config.model.model_type == "kimi_k2"
    # Described as MLA like its target: latent + rope head, MLA on.
    assert draft_config.is_deepseek_mla
    assert draft_config.get_head_size() == 16 + 16
