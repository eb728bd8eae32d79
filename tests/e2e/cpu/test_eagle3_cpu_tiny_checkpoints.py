# SPDX-License-Identifier: Apache-2.0
"""tools/tiny_checkpoints.py: the generator the CPU and GPU e2e tests rely on.

Fast checks (no engine): the CLI runs, output is seeded and reproducible, the
tokenizer loads offline through transformers, the DeepSeek-V3 checkpoint has
what the tests claim (MoE with shared experts after dense layers, noaux_tc
routing with a non-zero correction bias, a 64-wide head) and loads into
transformers' DeepseekV3ForCausalLM without missing or unexpected weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Independent of the series (the generator imports no vLLM): passes on stock
# too, hence "regression" (exempt from the must-fail-on-stock check).
pytestmark = [pytest.mark.e2e, pytest.mark.regression]

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL = REPO_ROOT / "tools" / "tiny_checkpoints.py"


KINDS = ("deepseek-v3", "kimi-k25", "glm5", "eagle3-drafter")


def test_cli_runs(tmp_path: Path) -> None:
    help_out = subprocess.run(
        [sys.executable, str(TOOL), "--help"], capture_output=True, text=True, check=True
    ).stdout
    for kind in KINDS:
        assert kind in help_out
    out = tmp_path / "dsv3"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "deepseek-v3", str(out), "--seed", "7"],
        capture_output=True,
        text=True,
        check=True,
    )
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert name in proc.stdout and (out / name).is_file()


def test_each_kind_is_seeded_and_tiny(harness: ModuleType, tmp_path: Path) -> None:
    tc = harness.load_tiny_checkpoints()
    for kind in KINDS:
        a = tc.write_checkpoint(kind, tmp_path / f"{kind}-a", seed=7).outdir
        b = tc.write_checkpoint(kind, tmp_path / f"{kind}-b", seed=7).outdir
        c = tc.write_checkpoint(kind, tmp_path / f"{kind}-c", seed=8).outdir
        data = (a / "model.safetensors").read_bytes()
        assert len(data) < 16 * 2**20, f"{kind}: not tiny"
        assert data == (b / "model.safetensors").read_bytes(), f"{kind}: not seeded"
        assert data != (c / "model.safetensors").read_bytes(), f"{kind}: seed ignored"
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes()


def test_deepseek_v3_checkpoint_is_what_the_tests_claim(
    harness: ModuleType, tiny_ckpts: dict[str, Any]
) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    path = tiny_ckpts["dsv3"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["num_hidden_layers"] >= 6
    assert 0 < cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]
    assert cfg["topk_method"] == "noaux_tc" and cfg["n_shared_experts"] >= 1
    assert cfg["n_group"] > cfg["topk_group"] > 0
    assert cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] == 64 == cfg["v_head_dim"]
    assert AutoConfig.from_pretrained(path).model_type == "deepseek_v3"

    weights = load_file(str(path / "model.safetensors"))
    biases = [v for k, v in weights.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert all(b.abs().min() > 0 for b in biases), "correction bias must be non-zero"
    assert any(".mlp.shared_experts." in k for k in weights)
    assert "model.layers.0.mlp.gate_proj.weight" in weights  # dense first layer
    # Loads strictly (the helper asserts no missing/unexpected keys).
    hf = harness.load_hf_reference(path)
    last = cfg["num_hidden_layers"] - 1
    assert torch.equal(
        hf.model.layers[last].mlp.gate.e_score_correction_bias,
        weights[f"model.layers.{last}.mlp.gate.e_score_correction_bias"],
    )

    # The bias really steers routing: without it the same prompt ends in a
    # clearly different state, so matching HF also checks the engine's use
    # of e_score_correction_bias.
    ids = list(range(40, 90))
    with_bias = harness.hf_states(hf, ids).by_id[cfg["num_hidden_layers"]]
    for layer in hf.model.layers[cfg["first_k_dense_replace"] :]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    without = harness.hf_states(hf, ids).by_id[cfg["num_hidden_layers"]]
    assert (with_bias - without).abs().max().item() > 0.1

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Hello, EAGLE-3!")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("Hello, EAGLE-3!")
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, EAGLE-3!"
    assert len(tok) == cfg["vocab_size"]


def test_drafter_config_carries_aux_ids(tiny_ckpts: dict[str, Any]) -> None:
    all_ids = json.loads((tiny_ckpts["draft_all_ids"] / "config.json").read_text())
    assert all_ids["architectures"] == ["LlamaForCausalLMEagle3"]
    n = tiny_ckpts["dsv3_layers"]
    assert all_ids["eagle_aux_hidden_state_layer_ids"] == list(range(n + 1))
    default = json.loads((tiny_ckpts["draft_default_ids"] / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in default
