# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""speculative_config.disable_by_batch_size: nothing in vLLM's V1 engine reads
it, so setting it is refused while the config is built, naming the problem and
the fix. Stock v0.16.0 accepts it and runs speculative decoding at every batch
size; upstream removed the field (vllm-project/vllm#35060)."""

from __future__ import annotations

import pytest

from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs


@pytest.fixture
def target(tiny_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tiny_config("llama", "target")


@pytest.fixture
def spec(target, tiny_config):
    """``spec(method, **fields)``: the SpeculativeConfig of ``method`` on a tiny
    Llama target (eagle3: with a tiny EAGLE-3 head)."""
    model = ModelConfig(model=target, tokenizer=target, skip_tokenizer_init=True)
    drafter = tiny_config("llama_eagle3", "drafter")

    def build(method: str, **fields) -> SpeculativeConfig:
        if method == "eagle3":
            fields["model"] = drafter
        return SpeculativeConfig(
            method=method, num_speculative_tokens=3, target_model_config=model,
            target_parallel_config=ParallelConfig(), **fields,
        )

    return build


def _assert_names_problem_and_fix(message: str) -> None:
    assert "disable_by_batch_size=8" in message
    assert "no effect in vLLM's V1 engine" in message
    assert "Remove disable_by_batch_size from --speculative-config" in message


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_refused_at_config_time(spec, method):
    with pytest.raises(ValueError) as info:
        spec(method, disable_by_batch_size=8)
    _assert_names_problem_and_fix(str(info.value))
    # The same config without the setting builds as before.
    assert spec(method).disable_by_batch_size is None


def test_refused_through_the_speculative_config_flag(target):
    """What ``--speculative-config '{..., "disable_by_batch_size": 8}'`` builds:
    refused before the engine loads anything."""
    speculative = {"method": "ngram", "num_speculative_tokens": 3,
                   "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    args = dict(model=target, tokenizer=target, skip_tokenizer_init=True)
    with pytest.raises(ValueError) as info:
        EngineArgs(**args, speculative_config={**speculative, "disable_by_batch_size": 8}
                   ).create_engine_config()
    _assert_names_problem_and_fix(str(info.value))
    config = EngineArgs(**args, speculative_config=speculative).create_engine_config()
    assert config.speculative_config.method == "ngram"
