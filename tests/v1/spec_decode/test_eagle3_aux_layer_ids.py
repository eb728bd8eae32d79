# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where EAGLE-3 aux layer ids are read from, and what the runner logs.

Published drafters keep the ids either at the top level of their config
(``eagle_aux_hidden_state_layer_ids``) or nested under ``eagle_config`` (the
layout SGLang, SpecForge and TorchSpec write). v0.16.0 read only the top
level, so a nested-only drafter silently got the target's default layers.
The configs here are real ``transformers.LlamaConfig`` objects, as vLLM loads
a Llama-architecture drafter's config.json.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from vllm.config.speculative import get_eagle3_aux_layer_ids
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

TOP = "eagle_aux_hidden_state_layer_ids"
NESTED = "eagle_config.eagle_aux_hidden_state_layer_ids"


def draft_config(**fields) -> LlamaConfig:
    return LlamaConfig.from_dict({"architectures": ["LlamaForCausalLMEagle3"], **fields})


def test_top_level_ids():
    assert get_eagle3_aux_layer_ids(draft_config(**{TOP: [1, 29, 57]})) == (
        (1, 29, 57),
        TOP,
    )


def test_nested_ids_are_read():
    config = draft_config(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
    )
    assert get_eagle3_aux_layer_ids(config) == ((2, 30, 58), NESTED)


def test_equal_ids_in_both_places():
    config = draft_config(
        **{TOP: [2, 30, 58]},
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]},
    )
    assert get_eagle3_aux_layer_ids(config) == ((2, 30, 58), TOP)


def test_conflicting_ids_name_both():
    config = draft_config(
        **{TOP: [3, 31, 59]},
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]},
    )
    with pytest.raises(ValueError) as exc_info:
        get_eagle3_aux_layer_ids(config)
    msg = str(exc_info.value)
    assert f"{TOP}=[3, 31, 59]" in msg
    assert f"{NESTED}=[2, 30, 58]" in msg


@pytest.mark.parametrize(
    "fields",
    [{TOP: 30}, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": "2,30,58"}}],
)
def test_ids_that_are_not_a_list_are_refused(fields):
    with pytest.raises(ValueError, match=r"must be a list of target layer ids"):
        get_eagle3_aux_layer_ids(draft_config(**fields))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {TOP: []},
        {TOP: None},
        {"eagle_config": {"use_aux_hidden_state": True}},
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": []}},
    ],
)
def test_no_ids(fields):
    assert get_eagle3_aux_layer_ids(draft_config(**fields)) is None


class _Target:
    """The target model's EAGLE-3 interface, recording what it is told."""

    def __init__(self) -> None:
        self.layers: tuple[int, ...] | None = None

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return (2, 30, 58)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(layers)


def run_set_aux_layers(monkeypatch, hf_config) -> tuple[_Target, str]:
    """GPUModelRunner._set_eagle3_aux_layers on a runner with only the
    attributes it reads; returns the target and the logged line."""
    runner = object.__new__(GPUModelRunner)
    runner.model = _Target()
    runner.model_config = SimpleNamespace(
        hf_text_config=SimpleNamespace(num_hidden_layers=61)
    )
    runner.speculative_config = SimpleNamespace(
        draft_model_config=SimpleNamespace(hf_config=hf_config)
    )
    lines: list[str] = []
    monkeypatch.setattr(
        gpu_model_runner.logger, "info", lambda fmt, *args: lines.append(fmt % args)
    )
    runner._set_eagle3_aux_layers()
    (line,) = [line for line in lines if "EAGLE-3" in line]
    return runner.model, line


def test_runner_uses_nested_ids_and_logs_their_source(monkeypatch):
    config = draft_config(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
    )
    target, line = run_set_aux_layers(monkeypatch, config)
    assert target.layers == (2, 30, 58)
    assert NESTED in line
    assert "id 2 = the input of layer 2 (the output of layer 1)" in line
    assert "id 58 = the input of layer 58 (the output of layer 57)" in line


def test_runner_logs_the_target_default_and_final_layer(monkeypatch):
    target, line = run_set_aux_layers(monkeypatch, draft_config())
    assert target.layers == (2, 30, 58)
    assert "the default of _Target" in line

    target, line = run_set_aux_layers(monkeypatch, draft_config(**{TOP: [0, 61]}))
    assert target.layers == (0, 61)
    assert f"the draft model config's {TOP}" in line
    assert "id 0 = the embeddings" in line
    assert "id 61 = the output of the last layer (60) before the final norm" in line
