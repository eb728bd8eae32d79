# SPDX-License-Identifier: Apache-2.0
"""A published drafter's nested aux ids, captured by the real v0.16.0 engine.

The target is a shrunk copy of the published DeepSeek-R1-0528 config
(tests/v1/spec_decode/published_configs, see PROVENANCE.md there): its 61
layers, its first 3 dense layers, its grouped routing (8 groups, 4 chosen)
and routed_scaling_factor, with the widths cut so it runs on a CPU. The
drafter carries SpecForge's DeepSeek-V3 config's aux ids exactly where that
config has them, in eagle_config only. v0.16.0 ignored that field and fed the
target's default layers; the engine must capture the named layers, and they
must equal transformers' DeepseekV3ForCausalLM's inputs of those layers on the
same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.e2e

PUBLISHED = Path(__file__).parents[2] / "v1" / "spec_decode" / "published_configs"
PROMPTS = ["Hi", "EAGLE-3 drafts tokens; the target v3."]
ATOL = 2e-4


def test_nested_ids_of_a_published_drafter_on_a_shrunk_published_target(
    harness: ModuleType, tmp_path: Path
) -> None:
    real_target = json.loads(
        (PUBLISHED / "deepseek-r1-0528-target-ttmetal" / "config.json").read_text()
    )
    real_draft = json.loads(
        (PUBLISHED / "specforge-deepseek-v3-671b-eagle3" / "config.json").read_text()
    )
    ids = real_draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert "eagle_aux_hidden_state_layer_ids" not in real_draft
    structure = {
        k: real_target[k]
        for k in (
            "num_hidden_layers",
            "first_k_dense_replace",
            "n_group",
            "topk_group",
            "topk_method",
            "scoring_func",
            "routed_scaling_factor",
            "norm_topk_prob",
        )
    }
    tc = harness.load_tiny_checkpoints()
    target = tc.write_checkpoint(
        "deepseek-v3", tmp_path / "target", seed=11, n_routed_experts=16,
        num_experts_per_tok=4, **structure,
    ).outdir
    draft = tc.write_checkpoint(
        "eagle3-drafter", tmp_path / "draft", seed=12, aux_layer_ids=ids
    ).outdir
    # As SpecForge writes it: the ids in eagle_config only.
    config_path = Path(draft) / "config.json"
    config = json.loads(config_path.read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    config_path.write_text(json.dumps(config))

    run = harness.run_prompts(
        target, draft, PROMPTS, max_tokens=3, step_budget=64
    )
    assert run["report"]["setup"].source == "draft config"
    hf_model = harness.load_hf_reference(target)
    assert hf_model.config.num_hidden_layers == 61
    nums = harness.compare_aux_with_hf(hf_model, run, tuple(ids), ATOL)
    print(f"\nSpecForge ids {ids} on a 61-layer DeepSeek-R1 shape: {nums}")
    assert nums["max_abs_err"] <= ATOL, nums
    assert nums["margin"] >= 100, nums
