# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How an EAGLE-3 drafter with a DeepSeek MLA draft layer reaches its model
class (SpeculativeConfig -> EAGLEConfig -> registry) and the proposer. Tiny
config.json files; the proposer runs up to where it hands the drafter's fused
hidden states on.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import DeepseekV3Config

from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

HIDDEN = 64  # the tiny configs' hidden_size (conftest.py)
MLA = dict(q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
           torch_dtype="float32")
EAGLE3_FIELDS = dict(draft_vocab_size=128, eagle_aux_hidden_state_layer_ids=[1, 2, 4])
DRAFT = dict(MLA, architectures=["Eagle3DeepseekV2ForCausalLM"], num_hidden_layers=1,
             n_routed_experts=None, **EAGLE3_FIELDS)


@pytest.fixture
def draft_config(tiny_config, tmp_path, monkeypatch):
    """``draft_config(name, method="eagle3", **fields)``: the SpeculativeConfig
    for a deepseek_v3-based drafter config with ``fields``, on a DeepSeek-V3
    target."""
    # The registry inspects model classes in a `python -m` subprocess, which
    # from the repository root would import the pristine vllm/ tree there.
    monkeypatch.chdir(tmp_path)
    # 8 layers: the default ids (2, 4, 5) of a drafter that names none are valid.
    path = tiny_config("deepseek_v3", "target", num_hidden_layers=8, **MLA)
    target = ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True)

    def build(name: str, method: str | None = "eagle3", **fields) -> SpeculativeConfig:
        return SpeculativeConfig(
            method=method, model=tiny_config("deepseek_v3", name, **fields),
            num_speculative_tokens=3, target_model_config=target,
            target_parallel_config=ParallelConfig(),
        )

    return build


def test_deepseek_type_eagle3_drafter_keeps_its_architecture(draft_config):
    draft = draft_config("mla_draft", **DRAFT).draft_model_config
    assert draft.architectures == ["Eagle3DeepseekV2ForCausalLM"]
    assert draft.architecture == "Eagle3DeepseekV2ForCausalLM"
    assert draft.hf_config.model.model_type == "deepseek_v3"
    assert draft.hf_config.eagle_aux_hidden_state_layer_ids == [1, 2, 4]


def test_plain_deepseek_v3_drafter_with_method_eagle3(draft_config):
    # No EAGLE-3 field at all: the explicit method decides.
    plain = {k: v for k, v in DRAFT.items() if k not in EAGLE3_FIELDS}
    plain["architectures"] = ["DeepseekV3ForCausalLM"]
    draft = draft_config("plain_v3_draft", **plain).draft_model_config
    assert draft.architectures == ["Eagle3DeepseekV3ForCausalLM"]
    assert draft.architecture == "Eagle3DeepseekV3ForCausalLM"


def test_method_detected_from_the_name_keeps_the_drafter(draft_config):
    # method None: "eagle3" in the path selects EAGLE-3 only after the draft
    # config was loaded, so the EAGLE-3 fields must keep it out of MTP.
    fields = {**DRAFT, "architectures": ["DeepseekV3ForCausalLM"]}
    config = draft_config("kimi-eagle3-mla", method=None, **fields)
    assert config.method == "eagle3"
    assert config.draft_model_config.architectures == ["Eagle3DeepseekV3ForCausalLM"]


@pytest.mark.regression
@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
def test_deepseek_checkpoint_without_eagle3_fields_is_still_mtp(model_type):
    cfg = DeepseekV3Config(num_nextn_predict_layers=1)
    cfg.model_type = model_type
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    out = SpeculativeConfig.hf_config_override(cfg)
    assert out.model_type == "deepseek_mtp"
    assert out.architectures == ["DeepSeekMTPModel"]
    assert out.n_predict == 1


@pytest.mark.parametrize(
    "marker",
    [
        {"architectures": ["Eagle3DeepseekV2ForCausalLM"]},
        {"architectures": ["DeepseekV3ForCausalLMEagle3"]},
        {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]},
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}},
        {"draft_vocab_size": 128},
    ],
)
def test_hf_config_override_leaves_eagle3_drafters_alone(marker):
    cfg = DeepseekV3Config()
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    for key, value in marker.items():
        setattr(cfg, key, value)
    out = SpeculativeConfig.hf_config_override(cfg)
    assert out.model_type == "deepseek_v3"
    assert out.architectures == marker.get("architectures", ["DeepseekV3ForCausalLM"])


class _Reached(Exception):
    pass


def _propose_until_first_pass(model, aux: torch.Tensor) -> torch.Tensor:
    """Run SpecDecodeBaseProposer.propose() until it hands the drafter's fused
    target states to set_inputs_first_pass, and return them."""
    from vllm.v1.spec_decode.eagle import SpecDecodeBaseProposer

    def first_pass(**kwargs):
        raise _Reached(kwargs["target_hidden_states"])

    proposer = SimpleNamespace(method="eagle3", model=model, hidden_size=HIDDEN,
                               set_inputs_first_pass=first_pass)
    with pytest.raises(_Reached) as reached:
        SpecDecodeBaseProposer.propose(
            proposer,
            target_token_ids=torch.zeros(aux.shape[0], dtype=torch.long),
            target_positions=torch.arange(aux.shape[0]),
            target_hidden_states=aux,
            next_token_ids=torch.zeros(1, dtype=torch.long),
            token_indices_to_sample=None,
            common_attn_metadata=SimpleNamespace(batch_size=lambda: 1),
            sampling_metadata=None,
        )
    return reached.value.args[0]


def test_proposer_accepts_the_mla_drafter():
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM

    # The drafter class with just the parts propose() touches first.
    drafter = object.__new__(Eagle3DeepseekV2ForCausalLM)
    nn.Module.__init__(drafter)
    drafter.model = inner = nn.Module()
    inner.use_aux_hidden_state = True
    inner.fc = nn.Linear(3 * HIDDEN, HIDDEN, bias=False)
    inner.fc_norm = None  # not an EAGLE-3.1 drafter
    aux = torch.randn(5, 3 * HIDDEN)
    torch.testing.assert_close(_propose_until_first_pass(drafter, aux), inner.fc(aux))


@pytest.mark.regression
def test_proposer_still_refuses_other_models_for_eagle3():
    with pytest.raises(AssertionError):
        model, aux = nn.Linear(3 * HIDDEN, HIDDEN), torch.randn(2, 3 * HIDDEN)
        _propose_until_first_pass(model, aux)
