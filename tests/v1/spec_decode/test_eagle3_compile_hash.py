# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The torch.compile cache key of an EAGLE-3 run follows the drafter.

vLLM loads compiled pieces from the directory named by
VllmConfig.compute_hash() by piece index, without comparing graphs, so the
speculative config's hash must change with the target's aux layers, with
whether the target returns aux states, and with the drafter itself. The
drafter is always written to one directory: only its config differs. A Llama
target is used where stock v0.16.0 accepts it, so that on stock these fail
on the hash, not on the target allow-list.
"""

from __future__ import annotations

import pytest

from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.config.speculative import SpeculativeConfig

TOP = "eagle_aux_hidden_state_layer_ids"
IDS, OTHER_IDS = [1, 4, 7], [2, 4, 5]
NO_AUX = {"use_aux_hidden_state": False}


@pytest.fixture
def spec(tiny_config):
    """``spec(target_kind, **drafter_fields)``: the SpeculativeConfig."""

    def build(target_kind: str, spec_fields=None, **drafter_fields) -> SpeculativeConfig:
        path = tiny_config(target_kind, f"target_{target_kind}")
        target = ModelConfig(
            model=path, tokenizer=path, skip_tokenizer_init=True, dtype="bfloat16"
        )
        drafter = tiny_config("llama_eagle3", "drafter", **drafter_fields)
        return SpeculativeConfig(
            method="eagle3", model=drafter, num_speculative_tokens=3,
            target_model_config=target, target_parallel_config=ParallelConfig(),
            **(spec_fields or {}),
        )

    return build


@pytest.mark.regression
def test_same_drafter_same_hash(spec):
    first = spec("llama", **{TOP: IDS}).compute_hash()
    assert first == spec("llama", **{TOP: IDS}).compute_hash()


@pytest.mark.parametrize(
    "target_kind, before, after",
    [
        ("llama", {TOP: IDS}, {TOP: OTHER_IDS}),
        ("llama", {}, {TOP: IDS}),
        ("llama", {TOP: IDS}, {TOP: IDS, "eagle_config": NO_AUX}),
        # Same aux ids: only the drafter's own config differs.
        ("llama", {TOP: IDS}, {TOP: IDS, "intermediate_size": 256}),
        ("llama", {"eagle_config": {TOP: IDS}}, {"eagle_config": {TOP: OTHER_IDS}}),
        ("deepseek_v3", {TOP: IDS}, {TOP: OTHER_IDS}),
    ],
    ids=["aux_ids", "no_ids_vs_ids", "use_aux_hidden_state", "another_drafter",
         "nested_aux_ids", "deepseek_target_aux_ids"],
)
def test_drafter_change_changes_the_hash(spec, target_kind, before, after):
    before_hash = spec(target_kind, **before).compute_hash()
    assert before_hash != spec(target_kind, **after).compute_hash()


@pytest.mark.parametrize(
    "before, after",
    [(None, "TRITON_ATTN"), ("TRITON_ATTN", "FLASH_ATTN"), ("FLASH_ATTN", None)],
    ids=["auto_vs_named", "named_vs_other", "named_vs_auto"],
)
def test_drafter_attention_backend_changes_the_hash(spec, before, after):
    """The drafter's graph shares the target's cache directory, and its
    backend (speculative_config.attention_backend) is not the target's, which
    AttentionConfig hashes: a drafter compiled under one backend must not be
    loaded for a run that asked for another."""

    def spec_hash(backend):
        fields = {} if backend is None else {"attention_backend": backend}
        return spec("llama", fields, **{TOP: IDS}).compute_hash()

    assert spec_hash(before) != spec_hash(after)
    assert spec_hash(after) == spec_hash(after)


def test_vllm_config_hash_names_another_cache_directory(spec):
    """What names the cache directory (VllmConfig.compute_hash) changes too."""

    def vllm_hash(ids):
        s = spec("llama", **{TOP: ids})
        # An explicit device: without a GPU the CUDA build cannot infer one.
        return VllmConfig(
            model_config=s.target_model_config, speculative_config=s,
            device_config=DeviceConfig(device="cpu"),
        ).compute_hash()

    assert vllm_hash(IDS) != vllm_hash(OTHER_IDS)
