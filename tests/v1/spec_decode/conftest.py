# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny config.json-only targets and drafters for the SpeculativeConfig tests
here: nothing is loaded, so no weights are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

_TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=256, max_position_embeddings=128, torch_dtype="bfloat16",
)
TINY_CONFIGS = {
    "llama": dict(_TINY, architectures=["LlamaForCausalLM"], model_type="llama",
                  num_hidden_layers=8),
    "deepseek_v3": dict(
        _TINY, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        num_hidden_layers=8,
        # MLA, then MoE after one dense layer
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1,
    ),
    "llama_eagle3": dict(_TINY, architectures=["LlamaForCausalLMEagle3"],
                         model_type="llama", num_hidden_layers=1, draft_vocab_size=256),
}


@pytest.fixture
def tiny_config(tmp_path: Path):
    """``tiny_config(kind, name, **fields)`` writes ``tmp_path/name/config.json``:
    the tiny ``kind`` config with ``fields`` over it; returns the directory."""

    def write(kind: str, name: str, **fields) -> str:
        path = tmp_path / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**TINY_CONFIGS[kind], **fields}))
        return str(path)

    return write
