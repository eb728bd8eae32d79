# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Published EAGLE-3 drafter configs for DeepSeek and Kimi targets
(published_configs/, verbatim; PROVENANCE.md gives repository, path and
commit): what vLLM makes of each, i.e. that SpeculativeConfig accepts it, its
drafter class, vocabulary, hidden size, and the aux ids vLLM captures (in
vLLM's numbering) and from which field. The targets are published files too:
DeepSeek-R1-0528's config.json and moonshotai/Kimi-K2.5's (the INT4 release,
vendored in ai-dynamo/aiconfigurator). No verbatim Kimi-K2 target config was
found, so the Kimi-K2 drafter is checked against Kimi-K2.5, whose text model
is Kimi-K2's architecture (DeepseekV3ForCausalLM, model_type kimi_k2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from vllm.config.speculative import get_eagle3_aux_layer_ids
from vllm.model_executor.models.registry import ModelRegistry

CONFIGS = Path(__file__).parent / "published_configs"
DEEPSEEK_R1 = CONFIGS / "deepseek-r1-0528-target-ttmetal"
KIMI_K25 = CONFIGS / "moonshotai-kimi-k25-target"
NESTED = "eagle_config.eagle_aux_hidden_state_layer_ids"
DEFAULT = "target default"

DS, KIMI = "deepseek", "kimi"
LLAMA, MLA = "Eagle3LlamaForCausalLM", "Eagle3DeepseekV2ForCausalLM"
# drafter: (target, class, draft vocab, ids vLLM uses, from). All have hidden
# size 7168 and 3 aux states.
EXPECTED = {
    "specforge-deepseek-v3-671b-eagle3": (DS, LLAMA, 32000, (1, 29, 57), NESTED),
    "specforge-deepseek-v3-671b-eagle3-pr378": (DS, LLAMA, 32000, (1, 29, 57), NESTED),
    "specforge-deepseek-r1-671b-eagle3": (DS, LLAMA, 32000, (1, 29, 57), NESTED),
    "specforge-deepseek-r1-eagle3-mla": (DS, MLA, 32000, (2, 30, 58), DEFAULT),
    "specforge-kimi-k2-eagle3": (KIMI, LLAMA, 32000, (2, 30, 58), NESTED),
    "specforge-kimi-k25-eagle3": (KIMI, LLAMA, 32000, (2, 30, 58), NESTED),
    "torchspec-kimi-k25-eagle3": (KIMI, LLAMA, None, (2, 30, 58), DEFAULT),
    "torchspec-kimi-k25-eagle3-mla": (KIMI, MLA, 163840, (1, 29, 57), NESTED),
}


@pytest.fixture(scope="module")
def targets() -> dict[str, ModelConfig]:
    return {
        name: ModelConfig(
            model=str(path), tokenizer=str(path), skip_tokenizer_init=True,
            dtype="bfloat16", trust_remote_code=False,
        )
        for name, path in (("deepseek", DEEPSEEK_R1), ("kimi", KIMI_K25))
    }


def test_the_deepseek_target_is_the_published_file(targets):
    text = targets["deepseek"].hf_text_config
    assert text.model_type == "deepseek_v3"
    assert (text.num_hidden_layers, text.hidden_size) == (61, 7168)
    assert targets["deepseek"].quantization == "fp8"


def test_the_kimi_target_is_the_published_file(targets):
    kimi = targets["kimi"]
    published = json.loads((KIMI_K25 / "config.json").read_text())
    # vLLM's own KimiK25Config, not the auto_map's remote code.
    assert type(kimi.hf_config).__name__ == "KimiK25Config"
    assert kimi.hf_config.model_type == "kimi_k25"
    assert kimi.architectures == ["KimiK25ForConditionalGeneration"]
    text = kimi.hf_text_config
    assert text.model_type == "kimi_k2" and kimi.use_mla
    assert (
        text.num_hidden_layers, text.hidden_size, text.n_routed_experts,
        text.moe_intermediate_size, text.first_k_dense_replace,
        text.num_attention_heads, text.kv_lora_rank, text.q_lora_rank, text.vocab_size,
    ) == (61, 7168, 384, 2048, 1, 64, 512, 1536, 163840)
    # INT4 routed experts, as released: the text_config's quantization_config.
    assert kimi.quantization == "compressed-tensors"
    assert text.quantization_config == published["text_config"]["quantization_config"]


@pytest.mark.parametrize("drafter", sorted(EXPECTED))
def test_published_drafter(targets, drafter):
    target, cls_name, draft_vocab, ids, source = EXPECTED[drafter]
    spec = SpeculativeConfig(
        method="eagle3", model=str(CONFIGS / drafter), num_speculative_tokens=3,
        target_model_config=targets[target], target_parallel_config=ParallelConfig(),
    )
    draft = spec.draft_model_config
    cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    assert cls.__name__ == cls_name
    hf = draft.hf_config
    assert getattr(hf, "draft_vocab_size", None) == draft_vocab
    assert hf.hidden_size == 7168 == targets[target].get_hidden_size()
    if cls_name == MLA:
        # Its draft layer joins the target's MLA KV cache, so vLLM builds it
        # only with the target's attention geometry: the published pair has it.
        text = targets[target].hf_text_config
        for field in (
            "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "num_attention_heads",
        ):
            assert getattr(hf, field) == getattr(text, field), field

    found = get_eagle3_aux_layer_ids(hf)
    if source == DEFAULT:
        assert found is None
        n = targets[target].hf_text_config.num_hidden_layers
        used = (2, n // 2, n - 3)  # DeepseekV2ForCausalLM's default
    else:
        used, field = found
        assert field == source
    assert used == ids
    assert len(used) == 3


def test_eagle31_flags_survive_vllm_config_loading():
    # SpecForge's only published EAGLE-3.1 drafter config (for Qwen3).
    from vllm.transformers_utils.config import get_config

    hf = get_config(str(CONFIGS / "specforge-qwen3-30b-a3b-eagle3.1"), False)
    assert (hf.fc_norm, hf.norm_output) == (True, True)
