# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The torch.compile cache key of an EAGLE-3 run follows the drafter.

vLLM loads compiled pieces from the cache directory named by
VllmConfig.compute_hash() by piece index, without comparing graphs; the
speculative config's part of that hash must change whenever the graphs the
drafter needs change: the target's aux layers, whether the target returns aux
states at all, and the drafter model itself. The hashes are computed on real
SpeculativeConfig objects built from tiny local config files. A Llama target
is used where stock v0.16.0 accepts it, so that on stock these tests fail on
the hash, not on the target allow-list.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.config.speculative import SpeculativeConfig

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=128,
    torch_dtype="bfloat16",
)
LLAMA_TARGET = dict(
    COMMON, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=8
)
DEEPSEEK_TARGET = dict(
    COMMON,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    num_hidden_layers=8,
    moe_intermediate_size=32,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)
LLAMA_DRAFTER = dict(
    COMMON,
    architectures=["LlamaForCausalLMEagle3"],
    model_type="llama",
    num_hidden_layers=1,
    draft_vocab_size=256,
    eagle_aux_hidden_state_layer_ids=[1, 4, 7],
)


def _write(path: Path, config: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _target(tmp_path: Path, config: dict = LLAMA_TARGET) -> ModelConfig:
    path = _write(tmp_path / f"target_{config['model_type']}", config)
    return ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True, dtype="bfloat16")


def _spec(target: ModelConfig, drafter: str, method: str = "eagle3") -> SpeculativeConfig:
    return SpeculativeConfig(
        method=method,
        model=drafter,
        num_speculative_tokens=3,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )


def _hash_with(tmp_path: Path, target: ModelConfig, **drafter_fields) -> str:
    """The hash for a drafter written to one fixed directory: only the
    config contents differ between calls, not the path."""
    return _spec(target, _write(tmp_path / "drafter", dict(LLAMA_DRAFTER, **drafter_fields))).compute_hash()


@pytest.mark.regression
def test_same_drafter_same_hash(tmp_path):
    target = _target(tmp_path)
    assert _hash_with(tmp_path, target) == _hash_with(tmp_path, target)


def test_aux_layer_ids_change_the_hash(tmp_path):
    target = _target(tmp_path)
    published_v3 = _hash_with(tmp_path, target, eagle_aux_hidden_state_layer_ids=[1, 4, 7])
    other = _hash_with(tmp_path, target, eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    assert published_v3 != other


def test_drafter_without_ids_hashes_apart_from_one_with_ids(tmp_path):
    target = _target(tmp_path)
    fields = dict(LLAMA_DRAFTER)
    del fields["eagle_aux_hidden_state_layer_ids"]
    path = tmp_path / "drafter_no_ids"
    no_ids = _spec(target, _write(path, fields)).compute_hash()
    # Same directory, now with ids: only the ids differ.
    with_ids = _spec(target, _write(path, dict(fields, eagle_aux_hidden_state_layer_ids=[1, 4, 7]))).compute_hash()
    assert no_ids != with_ids


def test_use_aux_hidden_state_changes_the_hash(tmp_path):
    target = _target(tmp_path)
    uses_aux = _hash_with(tmp_path, target)
    no_aux = _hash_with(tmp_path, target, eagle_config={"use_aux_hidden_state": False})
    assert uses_aux != no_aux


def test_another_drafter_in_the_same_directory_changes_the_hash(tmp_path):
    # Same path, same aux ids: only the drafter's own config differs, so this
    # fails unless the draft config's contents reach the hash.
    target = _target(tmp_path)
    assert _hash_with(tmp_path, target) != _hash_with(
        tmp_path, target, intermediate_size=256
    )


def test_nested_aux_layer_ids_change_the_hash(tmp_path):
    target = _target(tmp_path)
    fields = dict(LLAMA_DRAFTER)
    del fields["eagle_aux_hidden_state_layer_ids"]

    def nested(ids):
        config = dict(fields, eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        return _spec(target, _write(tmp_path / "drafter", config)).compute_hash()

    assert nested([1, 4, 7]) != nested([2, 4, 5])


def test_deepseek_target_hash_follows_the_aux_layer_ids(tmp_path):
    target = _target(tmp_path, DEEPSEEK_TARGET)
    assert _hash_with(tmp_path, target, eagle_aux_hidden_state_layer_ids=[1, 4, 7]) != _hash_with(
        tmp_path, target, eagle_aux_hidden_state_layer_ids=[2, 4, 5]
    )


def test_vllm_config_hash_names_another_cache_directory(tmp_path):
    """What names the cache directory (VllmConfig.compute_hash) changes too."""
    target = _target(tmp_path)

    def vllm_hash(ids):
        spec = _spec(target, _write(tmp_path / "drafter", dict(LLAMA_DRAFTER, eagle_aux_hidden_state_layer_ids=ids)))
        # An explicit device: without a GPU the CUDA build cannot infer one.
        return VllmConfig(
            model_config=target, speculative_config=spec, device_config=DeviceConfig(device="cpu")
        ).compute_hash()

    assert vllm_hash([1, 4, 7]) != vllm_hash([2, 4, 5])
