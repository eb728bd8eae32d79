# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EAGLE-3 on GLM-5 (GlmMoeDsaForCausalLM), from its published config.json.

The class comes from vLLM's registry for the real 78-layer config and is
built without its __init__: the aux-layer interface is checked on the class
vLLM serves GLM-5 with, at GLM-5's depth, with no weights or kernels.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

GLM5 = Path(__file__).resolve().parents[3] / "transformers_utils/data/zai-org--GLM-5"


@pytest.fixture(scope="module")
def model_config():
    from vllm.config import ModelConfig

    return ModelConfig(model=str(GLM5), tokenizer=str(GLM5), skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def glm5_cls(model_config):
    cls, arch = model_config.registry.resolve_model_cls(
        model_config.architectures, model_config
    )
    assert arch == "GlmMoeDsaForCausalLM"
    return cls


@pytest.fixture
def glm5(glm5_cls, model_config, monkeypatch):
    """GlmMoeDsaForCausalLM with GLM-5's config on one pipeline stage."""
    from vllm.model_executor.models import deepseek_v2

    group = SimpleNamespace(world_size=1)
    monkeypatch.setattr(deepseek_v2, "get_pp_group", lambda: group)
    lm = object.__new__(glm5_cls)
    nn.Module.__init__(lm)
    lm.config = model_config.hf_config
    lm.model = SimpleNamespace(aux_hidden_state_layers=())
    return lm


def test_registry_resolves_glm5_to_the_deepseek_v2_class(glm5_cls):
    from vllm.model_executor.models import deepseek_v2

    assert glm5_cls is deepseek_v2.GlmMoeDsaForCausalLM
    assert issubclass(glm5_cls, deepseek_v2.DeepseekV2ForCausalLM)


def test_glm5_class_supports_eagle3(glm5_cls, glm5):
    from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3

    assert SupportsEagle3 in glm5_cls.__mro__
    assert supports_eagle3(glm5_cls)
    assert supports_eagle3(glm5)


def test_default_aux_layers_at_78_layers(glm5):
    assert glm5.config.num_hidden_layers == 78
    # (2, n // 2, n - 3), as for the Llama/Qwen EAGLE-3 targets.
    assert glm5.get_eagle3_aux_hidden_state_layers() == (2, 39, 75)


@pytest.mark.parametrize("layers", [(2, 39, 75), [1, 38, 74], (0, 78), (78,)])
def test_set_aux_layers_accepts_ids_within_78_layers(glm5, layers):
    glm5.set_aux_hidden_state_layers(layers)
    assert glm5.model.aux_hidden_state_layers == tuple(layers)


@pytest.mark.parametrize(
    ("layers", "bad"),
    [((2, 39, 79), "79"), ((-1, 39, 75), "-1"), ((2, 39, 100), "100")],
)
def test_set_aux_layers_rejects_ids_beyond_78_layers(glm5, layers, bad):
    with pytest.raises(ValueError) as exc_info:
        glm5.set_aux_hidden_state_layers(layers)
    msg = str(exc_info.value)
    assert f"invalid ids [{bad}]" in msg
    assert "[0, 78]" in msg
    assert "eagle_aux_hidden_state_layer_ids" in msg
    assert glm5.model.aux_hidden_state_layers == ()
