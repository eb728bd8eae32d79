# SPDX-License-Identifier: Apache-2.0
"""Smoke tests: EAGLE-3 with an MLA-architecture drafter on a DeepSeek-V3 target, on a GPU.

Greedy equality shows the drafter loads and runs, not that it is fed the
right states (see test_eagle3_acceptance.py and test_eagle3_e2e.py's note).

The real v0.16.0 engine (scheduler, model runner, EAGLE proposer, rejection
sampler) serves the tiny random DeepSeek-V3 target with tiny random drafters
in the layout of the published "eagle3-mla" checkpoints
(``Eagle3DeepseekV2ForCausalLM``: a DeepSeek MLA draft layer over
[embeds, hidden], dense MLP, ``fc`` over the aux states, ``d2t``/``t2d``;
``tools/tiny_checkpoints.py`` kind ``eagle3-mla-drafter``), declared once with
model type ``deepseek_v3`` and once with ``kimi_k2`` (the Kimi drafters' type,
which ships no configuration code):

* greedy output with EAGLE-3 (k=3) equals greedy output without speculation,
  token for token, for prompts of different lengths;
* the drafter really drafted (spec-decode counters), and the engine resolved
  the draft model to ``Eagle3DeepseekV2ForCausalLM``.

Random weights mean low acceptance; the counters are recorded
(EAGLE3_GPU_RESULTS_DIR), not asserted beyond "drafts were made". The
drafter's forward math is checked against a written-out reference on CPU
(tests/models/test_deepseek_eagle3_drafter.py).

Settings as in gpu_e2e_helpers.py: float32, eager, and MLA off unless
EAGLE3_GPU_MLA=1 (then the draft layer is DeepseekV2MLAAttention and joins
the target's MLA KV-cache group). Stock v0.16.0 fails at config validation
(the DeepSeek-V3 target is refused for EAGLE-3) and, past that, cannot
resolve the drafter (it becomes "Eagle3DeepSeekMTPModel", or for kimi_k2
its config does not load).
"""

from __future__ import annotations

import json

import pytest

# conftest.py puts this directory on sys.path.
import gpu_e2e_helpers as h

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

DRAFTER_ARCH = "Eagle3DeepseekV2ForCausalLM"


@pytest.fixture(scope="module", autouse=True)
def _env():
    if h.profile() != "smoke":
        pytest.skip(h.SMOKE_ONLY)
    h.configure_env()


@pytest.fixture(scope="module")
def mla_drafters(tmp_path_factory):
    """One MLA drafter per declared model type, same weights (seed 4), sized
    for the deepseek-v3 target: aux ids (1, 3, 6), draft vocab 256."""
    tiny = h._tiny()
    root = tmp_path_factory.mktemp("eagle3-mla-drafters")
    return {
        model_type: tiny.write_checkpoint(
            "eagle3-mla-drafter", root / model_type, seed=4, model_type=model_type
        ).outdir
        for model_type in ("deepseek_v3", "kimi_k2")
    }


def _serve(model, prompts, max_tokens, drafter=None):
    from vllm import LLM

    llm = LLM(**h.engine_kwargs(model, drafter))
    try:
        arch = None
        if drafter is not None:
            spec = llm.llm_engine.vllm_config.speculative_config
            arch = spec.draft_model_config.architecture
        tokens, metrics = h.generate_tokens(llm, prompts, max_tokens)
        return tokens, metrics, arch
    finally:
        h.shutdown(llm)


@pytest.fixture(scope="module")
def plain_dsv3(tiny_ckpts):
    # The Llama-drafter test's vetted prompt set: the plain greedy path
    # depends only on the target and the prompts.
    prompts = h.token_prompts(h.DSV3_PROMPT_LENGTHS, seed=h.DSV3_PROMPT_SEED)
    tokens, metrics, _ = _serve(tiny_ckpts.deepseek_v3, prompts, h.DSV3_MAX_TOKENS)
    assert metrics["num_drafts"] == 0
    assert all(len(t) == h.DSV3_MAX_TOKENS for t in tokens)
    return prompts, tokens


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2"])
def test_smoke_deepseek_v3_mla_drafter_greedy_equals_plain(
    tiny_ckpts, mla_drafters, plain_dsv3, results_dir, model_type
):
    prompts, plain = plain_dsv3
    spec, metrics, arch = _serve(
        tiny_ckpts.deepseek_v3, prompts, h.DSV3_MAX_TOKENS, drafter=mla_drafters[model_type]
    )
    (results_dir / f"deepseek_v3_eagle3_mla_{model_type}.json").write_text(
        json.dumps(
            {
                "drafter_model_type": model_type,
                "drafter_architecture": arch,
                "prompt_lengths": h.DSV3_PROMPT_LENGTHS,
                "prompt_seed": h.DSV3_PROMPT_SEED,
                "max_tokens": h.DSV3_MAX_TOKENS,
                "num_speculative_tokens": h.NUM_SPEC_TOKENS,
                "equal": plain == spec,
                "plain": plain,
                "eagle3": spec,
                "spec_decode_metrics": metrics,
                "op_providers": h.op_providers(),
            },
            indent=1,
        )
    )
    assert arch == DRAFTER_ARCH
    h.assert_same_tokens(plain, spec, f"EAGLE-3 (MLA drafter, {model_type})")
    h.assert_drafted(metrics)
