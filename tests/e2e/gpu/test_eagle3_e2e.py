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

GLM-5 and DeepSeek-V3.2 (sparse attention, MLA only) are test_eagle3_dsa.py.

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
    assert_drafted,
    assert_same_tokens,
    configure_env,
    engine_kwargs,
    generate_tokens,
    SMOKE_ONLY,
    op_providers,
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


def _record(path, plain, spec, spec_metrics, **fields):
    path.write_text(json.dumps({
        **fields, "equal": plain == spec, "plain": plain, "eagle3": spec,
        "spec_decode_metrics": spec_metrics, "op_providers": op_providers()}, indent=1))


def test_smoke_deepseek_v3_eagle3_greedy_equals_plain(tiny_ckpts, results_dir):
    prompts = token_prompts(PROMPT_LENGTHS, seed=PROMPT_SEED)
    plain, plain_metrics = _serve(tiny_ckpts.deepseek_v3, prompts, MAX_TOKENS)
    spec, spec_metrics = _serve(
        tiny_ckpts.deepseek_v3, prompts, MAX_TOKENS, drafter=tiny_ckpts.drafter
    )
    _record(results_dir / "deepseek_v3_eagle3.json", plain, spec, spec_metrics,
            prompt_lengths=PROMPT_LENGTHS, prompt_seed=PROMPT_SEED,
            max_tokens=MAX_TOKENS, num_speculative_tokens=NUM_SPEC_TOKENS,
            aux_layer_ids=tiny_ckpts.info["drafter"]["eagle_aux_hidden_state_layer_ids"])
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
    _record(results_dir / "kimi_k25_eagle3.json", plain, spec, spec_metrics,
            prompts=KIMI_PROMPTS)
    assert len(plain) == len(KIMI_PROMPTS)
    assert_same_tokens(plain, spec)
    assert_drafted(spec_metrics)
