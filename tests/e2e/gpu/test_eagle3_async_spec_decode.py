# SPDX-License-Identifier: Apache-2.0
"""Async scheduling + EAGLE-3 without the wait for the previous step's
accepted counts (the series' backport of #32951), end to end on a CUDA GPU.

The tiny DeepSeek-V3 target serves the tiny random EAGLE-3 drafter (k = 3),
whose drafts are mostly rejected, so nearly every step's optimistic inputs
need correcting; prompts of different lengths and different max_tokens make
requests finish at different steps, so rows move between steps. Three
engines, smoke profile (float32, eager):

* plain decoding;
* EAGLE-3 with async scheduling (vLLM's default): the patched path. In its
  worker (async_spec_checks.py) every corrected step's device positions,
  seq_lens and slot mappings are compared with v0.16.0's synchronous formulas
  on the CPU, and waits for accepted counts while a step is being prepared
  are counted (none allowed);
* EAGLE-3 with async scheduling off: v0.16.0's synchronous path, which the
  patch leaves as it was.

Asserted: greedy output of both EAGLE-3 engines equals plain, token for
token; the patched path ran, corrected steps with rejected drafts and rows
that moved, with no mismatch and no wait; the acceptance counters of the two
EAGLE-3 engines are recorded and their acceptance rates must agree within
ACCEPTANCE_TOLERANCE (a weak check here: the random drafter's drafts are
nearly all rejected; test_eagle3_acceptance.py, which runs with async
scheduling too, is the acceptance proof). Without the patch the async engine
waits while preparing every decode step (waits_while_preparing > 0) and has
no correction to check, so the test fails.
"""

from __future__ import annotations

import json

import pytest

from gpu_e2e_helpers import (
    DSV3_PROMPT_LENGTHS,
    DSV3_PROMPT_SEED,
    NUM_SPEC_TOKENS,
    SMOKE_ONLY,
    assert_drafted,
    configure_env,
    counters_delta,
    engine_kwargs,
    profile,
    shutdown,
    spec_counters,
    token_prompts,
)

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

# Per prompt: a different max_tokens, so requests leave the batch at
# different steps and the others' rows move (condense).
MAX_TOKENS = [48, 20, 33, 41, 27]
# Both EAGLE-3 engines draft from the same greedy contexts; only the last
# steps of finishing requests can differ between the two schedulers.
ACCEPTANCE_TOLERANCE = 0.02


@pytest.fixture(scope="module", autouse=True)
def _env():
    if profile() != "smoke":
        pytest.skip(SMOKE_ONLY)
    configure_env()


def _generate(llm, prompts):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in MAX_TOKENS]
    before = spec_counters(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = spec_counters(llm)
    return [list(o.outputs[0].token_ids) for o in outs], counters_delta(before, after)


def _serve(model, prompts, drafter=None, **extra):
    import async_spec_checks
    from vllm import LLM

    llm = LLM(**engine_kwargs(model, drafter, **extra))
    try:
        llm.collective_rpc(async_spec_checks.install_checks)
        tokens, counters = _generate(llm, prompts)
        checks = llm.collective_rpc(async_spec_checks.read_checks)[0]
        return tokens, counters, checks
    finally:
        shutdown(llm)


def test_eagle3_async_spec_decode_corrects_on_device(tiny_ckpts, results_dir):
    prompts = token_prompts(DSV3_PROMPT_LENGTHS, seed=DSV3_PROMPT_SEED)
    assert len(prompts) == len(MAX_TOKENS)
    plain, _, _ = _serve(tiny_ckpts.deepseek_v3, prompts)
    spec, spec_metrics, checks = _serve(
        tiny_ckpts.deepseek_v3, prompts, drafter=tiny_ckpts.drafter,
        async_scheduling=True)
    sync, sync_metrics, sync_checks = _serve(
        tiny_ckpts.deepseek_v3, prompts, drafter=tiny_ckpts.drafter,
        async_scheduling=False)
    (results_dir / "eagle3_async_spec_decode.json").write_text(json.dumps({
        "max_tokens": MAX_TOKENS, "prompt_lengths": DSV3_PROMPT_LENGTHS,
        "num_speculative_tokens": NUM_SPEC_TOKENS,
        "equal_async": plain == spec, "equal_sync": plain == sync,
        "async": {"spec_decode_metrics": spec_metrics, "checks": checks},
        "sync": {"spec_decode_metrics": sync_metrics, "checks": sync_checks},
    }, indent=1))

    assert [len(t) for t in plain] == MAX_TOKENS
    assert spec == plain, "EAGLE-3 (async, no wait) output differs from plain greedy"
    assert sync == plain, "EAGLE-3 (synchronous) output differs from plain greedy"
    assert_drafted(spec_metrics)
    assert_drafted(sync_metrics)

    assert checks["use_async_spec_decode"], checks
    assert checks["mismatches"] == [], checks["mismatches"]
    assert checks["waits_while_preparing"] == 0, checks
    assert checks["corrected_steps"] > 0, checks
    assert checks["requests_with_rejections"] > 0, checks
    assert checks["requests_moved_rows"] > 0, checks
    # The synchronous engine is v0.16.0's path: nothing to correct.
    assert not sync_checks["use_async_spec_decode"], sync_checks
    assert sync_checks["corrected_steps"] == 0, sync_checks

    rate = spec_metrics["draft_acceptance_rate"]
    sync_rate = sync_metrics["draft_acceptance_rate"]
    assert abs(rate - sync_rate) <= ACCEPTANCE_TOLERANCE, (spec_metrics, sync_metrics)
