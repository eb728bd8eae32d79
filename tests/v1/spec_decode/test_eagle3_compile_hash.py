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

import pytest

from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.config.speculative import SpeculativeConfig

IDS = [1, 4, 7]


def _model_config(path: str) -> ModelConfig:
    return ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True, dtype="bfloat16")


def _spec(target: ModelConfig, drafter: str) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="eagle3",
        model=drafter,
        num_speculative_tokens=3,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )


@pytest.fixture
def target(tiny_config) -> ModelConfig:
    return _model_config(tiny_config("llama", "target"))


@pytest.fixture
def hash_with(tiny_config):
    """The hash for a drafter written to one fixed directory: only the
    config contents differ between calls, not the path."""

    def compute(target: ModelConfig, **drafter_fields) -> str:
        fields = {"eagle_aux_hidden_state_layer_ids": IDS, **drafter_fields}
        return _spec(target, tiny_config("llama_eagle3", "drafter", **fields)).compute_hash()

    return compute


@pytest.mark.regression
def test_same_drafter_same_hash(target, hash_with):
    assert hash_with(target) == hash_with(target)


def test_aux_layer_ids_change_the_hash(target, hash_with):
    assert hash_with(target) != hash_with(target, eagle_aux_hidden_state_layer_ids=[2, 4, 5])


def test_drafter_without_ids_hashes_apart_from_one_with_ids(target, tiny_config):
    no_ids = _spec(target, tiny_config("llama_eagle3", "drafter")).compute_hash()
    # Same directory, now with ids: only the ids differ.
    drafter = tiny_config("llama_eagle3", "drafter", eagle_aux_hidden_state_layer_ids=IDS)
    assert no_ids != _spec(target, drafter).compute_hash()


def test_use_aux_hidden_state_changes_the_hash(target, hash_with):
    assert hash_with(target) != hash_with(target, eagle_config={"use_aux_hidden_state": False})


def test_another_drafter_in_the_same_directory_changes_the_hash(target, hash_with):
    # Same path, same aux ids: only the drafter's own config differs, so this
    # fails unless the draft config's contents reach the hash.
    assert hash_with(target) != hash_with(target, intermediate_size=256)


def test_nested_aux_layer_ids_change_the_hash(target, tiny_config):
    def nested(ids):
        drafter = tiny_config("llama_eagle3", "drafter", eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        return _spec(target, drafter).compute_hash()

    assert nested(IDS) != nested([2, 4, 5])


def test_deepseek_target_hash_follows_the_aux_layer_ids(tiny_config, hash_with):
    target = _model_config(tiny_config("deepseek_v3", "target_deepseek_v3"))
    assert hash_with(target) != hash_with(target, eagle_aux_hidden_state_layer_ids=[2, 4, 5])


def test_vllm_config_hash_names_another_cache_directory(target, tiny_config):
    """What names the cache directory (VllmConfig.compute_hash) changes too."""

    def vllm_hash(ids):
        spec = _spec(target, tiny_config("llama_eagle3", "drafter", eagle_aux_hidden_state_layer_ids=ids))
        # An explicit device: without a GPU the CUDA build cannot infer one.
        return VllmConfig(
            model_config=target, speculative_config=spec, device_config=DeviceConfig(device="cpu")
        ).compute_hash()

    assert vllm_hash(IDS) != vllm_hash([2, 4, 5])
