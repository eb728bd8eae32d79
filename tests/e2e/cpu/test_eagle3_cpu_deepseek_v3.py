# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 aux hidden states from the real vLLM v0.16.0 CPU engine, DeepSeek-V3.

How the engine's aux path is driven on CPU (details in _eagle3_cpu_harness.py):
the CPU model runner refuses speculative decoding ("spec decode is not
supported") and its ``load_model`` lacks the GPU runner's EAGLE-3 block, so
the engine is started through ``vllm.LLM`` with ``worker_cls`` set to a
``CPUWorker`` subclass whose ``load_model`` runs the stock CPU load and then
the GPU runner's block (gpu_model_runner.py ~4189-4207) against the real
runner: the draft config is loaded by vLLM's own ``SpeculativeConfig``
(method eagle3, so the target allow-list applies), the runner's own
``_set_eagle3_aux_layers()`` reads ``eagle_aux_hidden_state_layer_ids`` from
it, and the model's ``set_aux_hidden_state_layers()`` receives the ids, all
before warm-up, as on
a GPU. ``use_aux_hidden_state_outputs`` is then True, as the EAGLE-3 drafter
would have set it, and the CPU runner's own ``execute_model`` unpacks
``(hidden, aux)`` and keeps the aux states for the drafter; the tests read
exactly those tensors after each step. No drafter runs (CPU cannot), no
forward is computed by hand. The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so ``collective_rpc`` returns the
recorded tensors directly. MLA is disabled (the CPU platform refuses it), and
the rotary CustomOp uses vLLM's native path because v0.16.0's CPU rotary
kernel mis-rotates DeepSeek's strided 3-D q_pe (a stock CPU bug, see the
harness docstring). The aux-off engine uses the same worker class with the
block skipped (no draft config): only the step recorder is installed, so both
runs are recorded, and their schedules compared, the same way.

Checks:
* aux states (ids 0..6 on a 6-layer target: embedding, every layer input and
  the last layer's output before the final norm) match transformers' own
  DeepseekV3ForCausalLM on the same weights and tokens, for every prompt and
  generated token of a batch run with chunked prefill; the tolerance is
  asserted to be far below the difference between neighbouring layers;
* greedy generation is token-for-token identical with aux capture on and off
  over prompts of different lengths, chunked prefill and decode both hit;
* an out-of-range id in the draft config fails engine start with the
  patched ValueError naming the bad id and the valid range.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

# Different lengths (byte-level tokenizer: 1 token per byte, plus BOS): 3, 38,
# 66 and 104 tokens, against a 16-token step budget.
PROMPTS = [
    "Hi",
    "EAGLE-3 drafts tokens; the target v3.",
    "DeepSeek-V3 routes each token to experts chosen by a biased gate.",
    "Speculative decoding runs a small draft head on hidden states the target "
    "model exposes at three depths.",
]
MAX_TOKENS = 10
STEP_TOKEN_BUDGET = 16  # max_num_batched_tokens: forces chunked prefill

# float32 on both sides; vLLM's CPU kernels (fused MoE, RMSNorm, paged
# attention) sum in a different order than transformers' eager code. Measured
# max |vLLM - HF| is ~1e-5 (states of magnitude ~10); the tolerance leaves
# headroom for other CPUs' vector widths.
ATOL = 2e-4
# A neighbouring layer's state must differ from the right one by at least
# this many tolerances, on every token, or an off-by-one could pass.
MIN_MARGIN = 100.0


@pytest.fixture(scope="module")
def aux_on(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    return harness.run_prompts(tiny_ckpts["dsv3"], tiny_ckpts["draft_all_ids"], PROMPTS,
                               max_tokens=MAX_TOKENS, step_budget=STEP_TOKEN_BUDGET)


@pytest.fixture(scope="module")
def aux_off(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    return harness.run_prompts(tiny_ckpts["dsv3"], None, PROMPTS,
                               max_tokens=MAX_TOKENS, step_budget=STEP_TOKEN_BUDGET)


@pytest.fixture(scope="module")
def hf_model(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> Any:
    return harness.load_hf_reference(tiny_ckpts["dsv3"])


def test_aux_states_match_hf_deepseek_v3(
    harness: ModuleType,
    tiny_ckpts: dict[str, Any],
    aux_on: dict[str, Any],
    hf_model: Any,
    record_property: Any,
) -> None:
    n = tiny_ckpts["dsv3_layers"]
    rep = aux_on["report"]
    assert rep["model_class"] == "DeepseekV3ForCausalLM"
    assert rep["setup"].source == "draft config"
    assert rep["setup"].draft_architectures == ["LlamaForCausalLMEagle3"]
    nums = harness.compare_aux_with_hf(hf_model, aux_on, tuple(range(n + 1)), ATOL)
    for key, value in nums.items():
        record_property(key, value)
    print(f"\nDeepSeek-V3 aux vs HF (ATOL={ATOL}): {nums}")
    assert nums["max_abs_err"] <= ATOL, nums
    assert nums["margin"] >= MIN_MARGIN, (
        f"tolerance {ATOL} is not far below the neighbouring-layer gap: {nums}"
    )
    # The engine's own greedy tokens agree with HF's argmax (wherever HF's
    # top-2 logits are not a near-tie), so the reference is the same model.
    assert nums["tokens_checked"] >= 0.9 * len(PROMPTS) * MAX_TOKENS, nums
    assert nums["token_mismatches"] == 0, nums


def test_greedy_identical_with_aux_on_and_off(
    harness: ModuleType, aux_on: dict[str, Any], aux_off: dict[str, Any]
) -> None:
    assert aux_off["report"]["use_aux_hidden_state_outputs"] is False
    assert aux_off["report"]["setup"] is None
    assert all(s["aux"] is None for s in aux_off["report"]["steps"])
    assert aux_on["prompt_ids"] == aux_off["prompt_ids"]
    assert len({len(p) for p in aux_on["prompt_ids"]}) == len(PROMPTS)
    for got, want in zip(aux_on["output_ids"], aux_off["output_ids"]):
        assert len(got) == MAX_TOKENS
        assert got == want
    # Same schedule in both runs (same batches, same chunks), so the token
    # comparison is like for like.
    layout = [s["num_scheduled"] for s in aux_on["report"]["steps"]]
    assert layout == [s["num_scheduled"] for s in aux_off["report"]["steps"]]

    # Both regimes really happened, with aux on: prompts split over several
    # steps (chunked prefill), single-token decode steps, and steps that mix
    # a decode with another request's prefill chunk.
    for run in (aux_on, aux_off):
        steps = run["report"]["steps"]
        rows = harness.match_requests(
            harness.rows_by_request(steps), run["prompt_ids"]
        )
        assert max(s["input_ids"].shape[0] for s in steps) <= STEP_TOKEN_BUDGET
        chunked = [
            r for r, p in zip(rows, run["prompt_ids"]) if len(p) > STEP_TOKEN_BUDGET
        ]
        assert chunked and all(
            len(r.chunks) >= 2 + MAX_TOKENS - 1 for r in chunked
        ), "long prompts were not prefilled in chunks"
        assert all(r.chunks[-(MAX_TOKENS - 1) :] == [1] * (MAX_TOKENS - 1) for r in rows)
        mixed = [
            s
            for s in steps
            if 1 in s["num_scheduled"] and any(c > 1 for c in s["num_scheduled"])
        ]
        assert mixed, "no step mixed decode and prefill"


def test_out_of_range_aux_layer_id_fails_at_engine_start(
    harness: ModuleType, tiny_ckpts: dict[str, Any]
) -> None:
    n = tiny_ckpts["dsv3_layers"]
    bad = n + 1
    kwargs = harness.engine_kwargs(tiny_ckpts["dsv3"], draft=tiny_ckpts["draft_bad_ids"])
    started = False
    with pytest.raises(ValueError) as excinfo:  # noqa: PT012
        with harness.running_engine(**kwargs):
            started = True
    assert not started, "the engine started; the error came later"
    msg = str(excinfo.value)
    assert str(bad) in msg, msg
    assert re.search(rf"\[\s*0\s*,\s*{n}\s*\]", msg), f"no valid range [0, {n}]: {msg}"
    assert "eagle_aux_hidden_state_layer_ids" in msg, msg
    # Raised by the model's own set_aux_hidden_state_layers, called from the
    # runner's load-time EAGLE-3 block while LLM(...) was being constructed.
    frames = [entry.name for entry in excinfo.traceback]
    assert "set_aux_hidden_state_layers" in frames, frames
    assert "enable_aux_like_gpu_runner" in frames, frames
