# SPDX-License-Identifier: Apache-2.0
"""Smoke tests: EAGLE-3 on DeepSeek-family targets, end to end on a CUDA GPU.

These show that the engine runs EAGLE-3 against each target and that
speculation does not change greedy output. They do not show that the drafter
gets the right hidden states: at temperature 0 rejection sampling makes the
output equal for any drafter. That proof is test_eagle3_acceptance.py. They
run in the smoke profile (float32, eager, MLA off; gpu_e2e_helpers.py) and
skip, with that reason, under another EAGLE3_GPU_PROFILE.

The real v0.16.0 engine (scheduler, model runner, EAGLE proposer, rejection
sampler) serves tiny random targets with tiny random EAGLE-3 drafters
(LlamaForCausalLMEagle3 with ``eagle_aux_hidden_state_layer_ids``):

* DeepSeek-V3: greedy output with EAGLE-3 (k=3) equals greedy output without
  speculation, token for token, for a batch of prompts of different lengths;
  the engine's spec-decode counters are recorded (EAGLE3_GPU_RESULTS_DIR).
* Kimi-K2.5: the drafter loads against the multimodal wrapper (the proposer
  reads the target's ``image_token_index``) and a text prompt is served with
  EAGLE-3, equal to plain greedy output.
* GLM-5: runs where its sparse-attention kernels exist (real wheel, Hopper,
  DeepGEMM); skipped with the reason elsewhere.

Stock v0.16.0 fails the first two at config validation ("Eagle3 is only
supported for [...] models") and, past that, at model load ("Model does not
support EAGLE3 interface").
"""

from __future__ import annotations

import json

import pytest

# conftest.py puts this directory on sys.path.
from gpu_e2e_helpers import (
    DSV3_MAX_TOKENS as MAX_TOKENS,
    DSV3_PROMPT_LENGTHS as PROMPT_LENGTHS,
    DSV3_PROMPT_SEED as PROMPT_SEED,
    NUM_SPEC_TOKENS,
    _tiny,
    assert_drafted,
    assert_same_tokens,
    configure_env,
    engine_kwargs,
    generate_tokens,
    SMOKE_ONLY,
    harness_in_use,
    profile,
    shutdown,
    token_prompts,
)

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]


@pytest.fixture(scope="module", autouse=True)
def _env():
    if profile() != "smoke":
        pytest.skip(SMOKE_ONLY)
    configure_env()


def _serve(model, prompts, max_tokens, drafter=None, **extra):
    from vllm import LLM

    llm = LLM(**engine_kwargs(model, drafter, **extra))
    try:
        return generate_tokens(llm, prompts, max_tokens)
    finally:
        shutdown(llm)


def test_smoke_deepseek_v3_eagle3_greedy_equals_plain(tiny_ckpts, results_dir):
    prompts = token_prompts(PROMPT_LENGTHS, seed=PROMPT_SEED)
    plain, plain_metrics = _serve(tiny_ckpts.deepseek_v3, prompts, MAX_TOKENS)
    spec, spec_metrics = _serve(
        tiny_ckpts.deepseek_v3, prompts, MAX_TOKENS, drafter=tiny_ckpts.drafter
    )
    (results_dir / "deepseek_v3_eagle3.json").write_text(json.dumps({
        "prompt_lengths": PROMPT_LENGTHS,
        "prompt_seed": PROMPT_SEED,
        "max_tokens": MAX_TOKENS,
        "num_speculative_tokens": NUM_SPEC_TOKENS,
        "aux_layer_ids": tiny_ckpts.info["drafter"]["eagle_aux_hidden_state_layer_ids"],
        "equal": plain == spec,
        "plain": plain,
        "eagle3": spec,
        "spec_decode_metrics": spec_metrics,
        "harness": harness_in_use(),
    }, indent=1))
    assert plain_metrics["num_drafts"] == 0
    assert all(len(t) == MAX_TOKENS for t in plain)
    assert len(plain) == len(prompts)
    assert_same_tokens(plain, spec)
    assert_drafted(spec_metrics)


KIMI_PROMPTS = [
    "Kimi, tell me a short story about a very small random model.",
    "2 + 2 =",
]


def test_smoke_kimi_k25_eagle3_text_prompt(tiny_ckpts, results_dir):
    # Text-only serving (no vision_chunk items allowed): the MoonViT tower is
    # not built, the language model and the EAGLE-3 path are the real ones.
    extra = {"limit_mm_per_prompt": {"vision_chunk": 0}}
    plain, _ = _serve(tiny_ckpts.kimi_k25, KIMI_PROMPTS, 32, **extra)
    spec, spec_metrics = _serve(
        tiny_ckpts.kimi_k25, KIMI_PROMPTS, 32, drafter=tiny_ckpts.drafter, **extra
    )
    (results_dir / "kimi_k25_eagle3.json").write_text(json.dumps({
        "prompts": KIMI_PROMPTS,
        "equal": plain == spec,
        "plain": plain,
        "eagle3": spec,
        "spec_decode_metrics": spec_metrics,
        "harness": harness_in_use(),
    }, indent=1))
    assert len(plain) == len(KIMI_PROMPTS)
    assert_same_tokens(plain, spec)
    assert_drafted(spec_metrics)


GLM5_HARNESS_REASON = (
    "GLM-5 (glm_moe_dsa) only runs through DeepSeek-V3.2 sparse attention (DSA), "
    "which the harness cannot reach: the config's index_topk makes vLLM 0.16 "
    "allocate a topk_indices_buffer, which the non-MLA DeepseekV2Attention "
    "(VLLM_MLA_DISABLE=1) rejects by assertion; with MLA on, the only sparse "
    "backend on CUDA is FLASHMLA_SPARSE (compiled vllm._flashmla_C, head size "
    "576, fp8_ds_mla or bf16 cache), and the indexer needs DeepGEMM "
    "(fp8_mqa_logits, fp8_paged_mqa_logits) plus the compiled "
    "indexer_k_quant_and_cache, cp_gather_indexer_k_quant_cache, "
    "top_k_per_row_prefill/decode and concat_and_cache_mla ops. None of them "
    "has a torch implementation in tools/gpu_harness."
)


def test_glm5_eagle3_greedy(tiny_ckpts, results_dir, monkeypatch, tmp_path):
    if harness_in_use():
        pytest.skip(GLM5_HARNESS_REASON)
    from vllm.utils.deep_gemm import has_deep_gemm
    from vllm.v1.attention.ops.flashmla import is_flashmla_sparse_supported

    ok, why = is_flashmla_sparse_supported()
    if not ok:
        pytest.skip(f"FLASHMLA_SPARSE unavailable: {why}")
    if not has_deep_gemm():
        pytest.skip("DeepGEMM is not installed (the DSA indexer needs it)")
    tiny = _tiny()
    glm = tmp_path / "glm5"
    # FlashMLA sparse needs kv_lora_rank + qk_rope_head_dim = 576 and bf16.
    tiny.write_checkpoint(
        "glm5", glm, seed=3, dtype="bfloat16", remote_code_config=True,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, index_head_dim=128, index_n_heads=32,
    )
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    monkeypatch.setenv("EAGLE3_GPU_MLA", "1")
    prompts = token_prompts([5, 33, 70], seed=3)
    extra = {"dtype": "bfloat16", "trust_remote_code": True}
    plain, _ = _serve(glm, prompts, 32, **extra)
    spec, metrics = _serve(glm, prompts, 32, drafter=tiny_ckpts.drafter, **extra)
    (results_dir / "glm5_eagle3.json").write_text(
        json.dumps({"plain": plain, "eagle3": spec, "spec_decode_metrics": metrics}, indent=1)
    )
    assert_drafted(metrics)
    # bf16: report agreement; most of the greedy output must agree.
    agree = sum(a == b for p, s in zip(plain, spec) for a, b in zip(p, s))
    assert agree >= 0.5 * sum(len(p) for p in plain), (plain, spec)
