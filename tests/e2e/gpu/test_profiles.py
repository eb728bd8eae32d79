# SPDX-License-Identifier: Apache-2.0
"""The GPU suite's engine profiles say what they claim (runs on CPU, no engine).

``production`` must be vLLM's defaults (no enforce_eager, no compilation
override, no forced attention backend), bf16 and MLA with the published
latent geometry; ``eager`` the same with enforce_eager; ``smoke`` the float32,
eager, MLA-off settings the greedy-equality tests need.
"""

from __future__ import annotations

import json

import pytest

import gpu_e2e_helpers as h


@pytest.fixture
def prof(monkeypatch):
    def set_(name):
        monkeypatch.setenv("EAGLE3_GPU_PROFILE", name)
        monkeypatch.delenv("EAGLE3_GPU_MLA", raising=False)
    return set_


def test_production_is_vllm_defaults_bf16_mla(prof, monkeypatch):
    prof("production")
    kw = h.engine_kwargs("/t", "/d")
    assert kw["dtype"] == "bfloat16"
    assert kw["enforce_eager"] is False
    assert "compilation_config" not in kw
    assert "attention_backend" not in kw
    assert kw["speculative_config"]["method"] == "eagle3"
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    h.configure_env()
    import os

    assert "VLLM_MLA_DISABLE" not in os.environ


def test_eager_differs_from_production_only_in_enforce_eager(prof):
    prof("production")
    a = h.engine_kwargs("/t", "/d")
    prof("eager")
    b = h.engine_kwargs("/t", "/d")
    assert b.pop("enforce_eager") is True and a.pop("enforce_eager") is False
    assert a == b


def test_smoke_profile(prof):
    prof("smoke")
    kw = h.engine_kwargs("/t")
    assert kw["dtype"] == "float32" and kw["enforce_eager"] is True
    assert kw["compilation_config"] == {"custom_ops": ["none"]}
    assert kw["attention_backend"] == "TRITON_ATTN"
    assert h.checkpoint_kwargs() == {}


def test_unknown_profile_is_refused(prof):
    prof("fast")
    with pytest.raises(ValueError, match="EAGLE3_GPU_PROFILE='fast'"):
        h.engine_kwargs("/t")


def test_production_checkpoints_have_the_published_latent_geometry(prof, tmp_path):
    prof("production")
    ck = h.make_checkpoints(tmp_path)
    cfg = json.loads((ck.deepseek_v3 / "config.json").read_text())
    # deepseek-ai/DeepSeek-V3 config.json: kv_lora_rank 512, qk_rope_head_dim 64,
    # qk_nope_head_dim 128, v_head_dim 128 (the MLA kernels need 512 + 64 = 576)
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"],
            cfg["v_head_dim"]) == (512, 64, 128, 128)
    assert cfg["torch_dtype"] == "bfloat16"
    kimi = json.loads((ck.kimi_k25 / "config.json").read_text())["text_config"]
    assert kimi["kv_lora_rank"] + kimi["qk_rope_head_dim"] == 576
    from safetensors import safe_open

    with safe_open(str(ck.deepseek_v3 / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    assert w.shape[0] == 576 and str(w.dtype) == "torch.bfloat16"


def test_token_agreement():
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    b = [[1, 2, 9, 4], [5, 6, 7, 8]]
    r = h.token_agreement(a, b)
    assert r["equal_prompts"] == 1 and r["first_divergence"] == [2, None]
    assert r["tokens_before_first_divergence"] == 2 + 4 and r["tokens"] == 8
