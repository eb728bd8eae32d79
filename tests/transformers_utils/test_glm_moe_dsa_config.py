# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5 (model type glm_moe_dsa) configs on vLLM with transformers < 5.

The reference is GLM-5's published config.json (data/zai-org--GLM-5, copied
verbatim; provenance in data/README.md): whatever vLLM builds from it must
say what the file says.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.transformers_utils import configs

DATA = Path(__file__).resolve().parent / "data"
GLM5 = DATA / "zai-org--GLM-5"
DSV32 = DATA / "deepseek-ai--DeepSeek-V3.2"
# The sha256 recorded in data/README.md when the files were copied.
PUBLISHED_SHA256 = {
    GLM5: "308d3ceebe7bd9c2246d20550d5b793098dd03838d1e504f8236063ae152bcae",
    DSV32: "c7fa8b191e9936d8e6a57d864baab82b792fae16a116416cdd3a75ba76bc5af1",
}

# What DeepseekV2ForCausalLM, its MoE, MLA attention and the DSA indexer
# (vllm/model_executor/models/deepseek_v2.py) read from the HF config.
MODEL_READS = [
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
    # MLA
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim",
    # MoE and routing
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob",
    "routed_scaling_factor", "n_group", "topk_group", "topk_method",
    "scoring_func", "num_nextn_predict_layers",
    # DSA indexer
    "index_topk", "index_n_heads", "index_head_dim", "indexer_rope_interleave",
]


def published(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def load(path: Path):
    from vllm.transformers_utils.config import get_config

    return get_config(str(path), trust_remote_code=False)


@pytest.mark.regression
@pytest.mark.parametrize("path", [GLM5, DSV32], ids=lambda p: p.name)
def test_fixture_is_the_published_file(path):
    digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    assert digest == PUBLISHED_SHA256[path], f"{path}/config.json was modified"


def test_glm5_config_loads_as_glm_moe_dsa():
    config = load(GLM5)
    assert isinstance(config, configs.GlmMoeDsaConfig)
    assert config.model_type == "glm_moe_dsa"
    assert config.architectures == ["GlmMoeDsaForCausalLM"]
    assert config.num_hidden_layers == 78
    assert config.hidden_size == 6144


def test_glm5_config_keeps_every_published_field():
    config = load(GLM5)
    saved = config.to_dict()
    for key, value in published(GLM5).items():
        if key == "transformers_version":
            continue  # to_dict() writes the running version by design
        assert saved[key] == value, key
        if key != "dtype":  # the attribute is the torch.dtype
            assert getattr(config, key) == value, key
    assert str(config.dtype) == "torch." + published(GLM5)["dtype"]


def test_glm5_gives_what_the_model_code_reads():
    config = load(GLM5)
    file = published(GLM5)
    for name in MODEL_READS:
        assert getattr(config, name) == file[name], name
    # Derived head sizes agree with the ones the file states.
    assert config.qk_head_dim == file["qk_nope_head_dim"] + file["qk_rope_head_dim"]
    assert config.qk_head_dim == file["qk_head_dim"]


def test_glm5_rope_theta_survives_rope_patching():
    # get_config runs vLLM's RoPE compatibility shim; with transformers 4 a
    # class that defaults rope_theta (DeepseekV3Config: 10000) would have
    # the default written over the checkpoint's theta.
    config = load(GLM5)
    assert config.rope_parameters == published(GLM5)["rope_parameters"]
    assert config.rope_parameters["rope_theta"] == 1000000


def test_model_config_describes_glm5_as_mla_with_dsa():
    from vllm.config import ModelConfig

    file = published(GLM5)
    config = ModelConfig(model=str(GLM5), tokenizer=str(GLM5), skip_tokenizer_init=True)
    assert config.architectures == ["GlmMoeDsaForCausalLM"]
    assert config.hf_text_config.model_type == "glm_moe_dsa"
    assert config.is_deepseek_mla
    # MLA caches the compressed latent plus the rope part of the key.
    assert config.get_head_size() == file["kv_lora_rank"] + file["qk_rope_head_dim"]
    assert config.get_total_num_hidden_layers() == file["num_hidden_layers"]
    assert config.max_model_len == file["max_position_embeddings"]
    assert str(config.dtype) == "torch." + file["dtype"]


def test_glm5_config_save_and_load_round_trip(tmp_path):
    load(GLM5).save_pretrained(tmp_path)
    restored = load(tmp_path)
    assert isinstance(restored, configs.GlmMoeDsaConfig)
    for name in MODEL_READS:
        assert getattr(restored, name) == published(GLM5)[name], name


def test_defaults_are_glm5():
    config, file = configs.GlmMoeDsaConfig(), published(GLM5)
    # RoPE is the exception: a config that names no theta gets 10000, as
    # with transformers' own class; indexer_rope_interleave is kept only
    # when given, so the model code's own default applies otherwise.
    for name in set(MODEL_READS) - {"rope_parameters", "indexer_rope_interleave"}:
        assert getattr(config, name) == file[name], name
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_legacy_rope_fields_fold_into_rope_parameters():
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    config = configs.GlmMoeDsaConfig(rope_theta=500000.0, rope_scaling=yarn)
    want = {**yarn, "rope_type": "yarn", "rope_theta": 500000.0}
    assert config.rope_parameters == want
    default = {"rope_type": "default", "rope_theta": 5.0}
    assert configs.GlmMoeDsaConfig(rope_theta=5.0).rope_parameters == default


def test_conflicting_rope_theta_is_refused():
    rope = {"rope_type": "default", "rope_theta": 1000000}
    with pytest.raises(ValueError, match=r"rope_theta=10000\.0 disagrees"):
        configs.GlmMoeDsaConfig(rope_theta=10000.0, rope_parameters=rope)


def test_mlp_layer_types_must_match_the_layers_vllm_builds():
    kwargs = dict(num_hidden_layers=5, first_k_dense_replace=2)
    good = ["dense", "dense", "sparse", "sparse", "sparse"]
    config = configs.GlmMoeDsaConfig(mlp_layer_types=good, **kwargs)
    assert config.mlp_layer_types == good
    with pytest.raises(ValueError, match=r"disagrees at layers \[1\]"):
        configs.GlmMoeDsaConfig(mlp_layer_types=["dense"] + ["sparse"] * 4, **kwargs)
    with pytest.raises(ValueError, match="must list 5 entries"):
        configs.GlmMoeDsaConfig(mlp_layer_types=good[:4], **kwargs)


@pytest.mark.regression
def test_deepseek_v32_config_still_loads_as_deepseek_v3_config():
    from transformers import DeepseekV3Config

    config, file = load(DSV32), published(DSV32)
    assert type(config) is DeepseekV3Config
    assert config.model_type == "deepseek_v32"
    assert config.index_topk == file["index_topk"]
    assert config.rope_parameters["rope_theta"] == file["rope_theta"]
    assert config.rope_parameters["factor"] == file["rope_scaling"]["factor"]


_COMPARE = """
import json, sys
import transformers
from transformers import AutoConfig
from vllm.transformers_utils.config import get_config
path, names = sys.argv[1], json.loads(sys.argv[2])
ours = get_config(path, trust_remote_code=False)
theirs = AutoConfig.from_pretrained(path)
print(json.dumps({
    "transformers": transformers.__version__,
    "ours": type(ours).__module__ + "." + type(ours).__name__,
    "theirs": type(theirs).__module__ + "." + type(theirs).__name__,
    "diff": {n: [repr(getattr(ours, n, None)), repr(getattr(theirs, n, None))]
             for n in names if getattr(ours, n, None) != getattr(theirs, n, None)},
}))
"""


def test_glm5_agrees_with_transformers_own_class(tmp_path):
    """With transformers >= 5.2 (which has its own GlmMoeDsaConfig) vLLM's
    registry still wins; both classes must agree on what the model code reads.
    EAGLE3_TRANSFORMERS5_SITE names a site put first on PYTHONPATH, e.g. from
    pip install --no-deps --target build/tf5 transformers==5.2.0
    'huggingface-hub>=1.3,<2' typer-slim"""
    site = os.environ.get("EAGLE3_TRANSFORMERS5_SITE")
    if not site:
        pytest.skip("EAGLE3_TRANSFORMERS5_SITE is not set (a transformers>=5.2 site)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, *filter(None, sys.path)]))
    proc = subprocess.run(
        [sys.executable, "-c", _COMPARE, str(GLM5), json.dumps(MODEL_READS)],
        capture_output=True, text=True, env=env, timeout=600,
        cwd=tmp_path,  # not the checkout, whose root holds the pristine vllm/
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    major_minor = tuple(int(x) for x in result["transformers"].split(".")[:2])
    assert major_minor >= (5, 2), result
    assert result["ours"] == f"{configs.__name__}.glm_moe_dsa.GlmMoeDsaConfig"
    assert result["theirs"].startswith("transformers.models.glm_moe_dsa."), result
    assert result["diff"] == {}, result
