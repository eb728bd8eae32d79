# SPDX-License-Identifier: Apache-2.0
"""GLM-5 (GlmMoeDsaForCausalLM, its published 78-layer config.json) with an
EAGLE-3 drafter, as far as the v0.16.0 engine gets on CPU: the engine config
and the runner's load-time aux-layer choice on the registry's class. The
forward cannot run: GLM-5's DSA indexer exists only in the MLA path, which
the CPU platform refuses; tests/e2e/gpu checks its aux states.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

GLM5 = Path(__file__).parents[2] / "transformers_utils" / "data" / "zai-org--GLM-5"
GLM5_CONFIG = json.loads((GLM5 / "config.json").read_text())
LAYERS = GLM5_CONFIG["num_hidden_layers"]
# Drafters by the aux ids their config.json names (None: the field is absent).
DRAFT_IDS: dict[str, list[int] | None] = {
    "explicit": [1, LAYERS // 2, LAYERS],
    "default": None,
    "past_the_end": [2, LAYERS // 2, LAYERS + 1],
}


@pytest.fixture(scope="module")
def engine_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from vllm.engine.arg_utils import EngineArgs

    root = tmp_path_factory.mktemp("glm5_drafters")
    made = {}
    for name, ids in DRAFT_IDS.items():
        # A Llama-architecture EAGLE-3 head (the common published kind).
        config: dict[str, Any] = dict(
            architectures=["LlamaForCausalLMEagle3"], model_type="llama",
            hidden_size=GLM5_CONFIG["hidden_size"], intermediate_size=16384,
            num_hidden_layers=1, num_attention_heads=48, num_key_value_heads=8,
            vocab_size=GLM5_CONFIG["vocab_size"], draft_vocab_size=32000,
            max_position_embeddings=GLM5_CONFIG["max_position_embeddings"],
            rms_norm_eps=1e-5, torch_dtype="bfloat16",
        )
        if ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = ids
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        args = EngineArgs(
            model=str(GLM5), skip_tokenizer_init=True, max_model_len=4096,
            speculative_config={"method": "eagle3", "model": str(root / name),
                                "num_speculative_tokens": 3},
        )
        try:
            made[name] = args.create_engine_config()
        except ValueError as exc:  # refused at config time: the test reads it
            made[name] = exc
    return made


def test_engine_config_takes_glm5_with_an_eagle3_drafter(engine_configs):
    from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM
    from vllm.model_executor.models.interfaces import supports_eagle3

    vllm_config = engine_configs["explicit"]
    target = vllm_config.model_config
    assert type(target.hf_config).__name__ == "GlmMoeDsaConfig"
    assert target.hf_config.num_hidden_layers == LAYERS == 78
    assert target.hf_config.index_topk == GLM5_CONFIG["index_topk"]
    assert target.is_deepseek_mla
    cls, arch = target.registry.resolve_model_cls(target.architectures, target)
    assert (cls, arch) == (GlmMoeDsaForCausalLM, "GlmMoeDsaForCausalLM")
    assert supports_eagle3(cls)

    spec = vllm_config.speculative_config
    assert spec.method == "eagle3"
    assert spec.num_speculative_tokens == 3
    draft = spec.draft_model_config.hf_config
    assert draft.eagle_aux_hidden_state_layer_ids == DRAFT_IDS["explicit"]


def _load_time_aux_layers(vllm_config) -> tuple[int, ...]:
    """GPUModelRunner's load-time EAGLE-3 choice, on the registry's class
    carrying GLM-5's config (no weights): the ids the model was given."""
    from torch import nn

    from vllm.model_executor.models import deepseek_v2
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    target = vllm_config.model_config
    cls, _ = target.registry.resolve_model_cls(target.architectures, target)
    model = object.__new__(cls)
    nn.Module.__init__(model)
    model.config = target.hf_config
    model.model = SimpleNamespace(aux_hidden_state_layers=())
    assert supports_eagle3(model)
    runner = SimpleNamespace(
        speculative_config=vllm_config.speculative_config, model_config=target,
        model=model,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deepseek_v2, "get_pp_group", lambda: SimpleNamespace(world_size=1))
        GPUModelRunner._set_eagle3_aux_layers(runner)
    return model.model.aux_hidden_state_layers


@pytest.mark.parametrize(
    "drafter, expected", [("explicit", (1, 39, 78)), ("default", (2, 39, 75))]
)
def test_load_time_aux_ids_at_78_layers(engine_configs, drafter, expected):
    assert _load_time_aux_layers(engine_configs[drafter]) == expected


def test_config_time_refuses_an_aux_id_past_78_layers(engine_configs):
    exc = engine_configs["past_the_end"]
    assert isinstance(exc, ValueError), exc
    msg = str(exc)
    assert "invalid ids [79]" in msg
    assert "[0, 78]" in msg
    assert "from the draft model config's eagle_aux_hidden_state_layer_ids" in msg
