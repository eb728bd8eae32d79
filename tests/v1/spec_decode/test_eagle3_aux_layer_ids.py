# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where EAGLE-3 aux layer ids are read from, and what the runner logs.

Published drafters keep the ids at the top level of their config or nested
under ``eagle_config`` (SGLang, SpecForge, TorchSpec); v0.16.0 read only the
top level, so a nested-only drafter silently got the target's default layers.
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


def draft_config(top=None, nested=None, **fields) -> LlamaConfig:
    """A drafter config as vLLM loads a Llama-architecture one, with ``top``
    and ``nested`` ids where given."""
    if top is not None:
        fields[TOP] = top
    if nested is not None:
        fields["eagle_config"] = {TOP: nested}
    fields["architectures"] = ["LlamaForCausalLMEagle3"]
    return LlamaConfig.from_dict(fields)


@pytest.mark.parametrize(
    "config, expected",
    [
        (dict(top=[1, 29, 57]), ((1, 29, 57), TOP)),
        (dict(nested=[2, 30, 58]), ((2, 30, 58), NESTED)),
        (dict(top=[2, 30, 58], nested=[2, 30, 58]), ((2, 30, 58), TOP)),
    ],
    ids=["top_level", "nested", "equal_in_both"],
)
def test_ids_and_their_source(config, expected):
    assert get_eagle3_aux_layer_ids(draft_config(**config)) == expected


def test_conflicting_ids_name_both():
    with pytest.raises(ValueError) as exc_info:
        get_eagle3_aux_layer_ids(draft_config(top=[3, 31, 59], nested=[2, 30, 58]))
    msg = str(exc_info.value)
    assert f"{TOP}=[3, 31, 59]" in msg
    assert f"{NESTED}=[2, 30, 58]" in msg


@pytest.mark.parametrize("config", [dict(top=30), dict(nested="2,30,58")])
def test_ids_that_are_not_a_list_are_refused(config):
    with pytest.raises(ValueError, match=r"must be a list of target layer ids"):
        get_eagle3_aux_layer_ids(draft_config(**config))


@pytest.mark.parametrize(
    "fields",
    [{}, {TOP: []}, {TOP: None}, {"eagle_config": {"use_aux_hidden_state": True}},
     {"eagle_config": {TOP: []}}],
)
def test_no_ids(fields):
    assert get_eagle3_aux_layer_ids(draft_config(**fields)) is None


class _Target:
    """The target model's EAGLE-3 interface, recording what it is told."""

    layers: tuple[int, ...] | None = None

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return (2, 30, 58)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(layers)


def run_set_aux_layers(monkeypatch, hf_config) -> tuple[_Target, str]:
    """GPUModelRunner._set_eagle3_aux_layers on a runner with only the
    attributes it reads; returns the target and the logged line."""
    runner = object.__new__(GPUModelRunner)
    runner.model = _Target()
    text_config = SimpleNamespace(num_hidden_layers=61)
    runner.model_config = SimpleNamespace(hf_text_config=text_config)
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
    target, line = run_set_aux_layers(monkeypatch, draft_config(nested=[2, 30, 58]))
    assert target.layers == (2, 30, 58)
    assert NESTED in line
    assert "id 2 = the input of layer 2 (the output of layer 1)" in line
    assert "id 58 = the input of layer 58 (the output of layer 57)" in line


def test_runner_logs_the_target_default_and_final_layer(monkeypatch):
    target, line = run_set_aux_layers(monkeypatch, draft_config())
    assert target.layers == (2, 30, 58)
    assert "the default of _Target" in line

    target, line = run_set_aux_layers(monkeypatch, draft_config(top=[0, 61]))
    assert target.layers == (0, 61)
    assert f"the draft model config's {TOP}" in line
    assert "id 0 = the embeddings" in line
    assert "id 61 = the output of the last layer (60) before the final norm" in line
